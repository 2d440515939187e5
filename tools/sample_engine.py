"""``orbitkv-sample-engine``: a stand-in inference engine that puts real data into a running
``orbitkv-cache-manager`` without a GPU, as a connector would, so that the control plane has something to
show (the README's curl walk, docs/control-plane.md).

Its KV pages are a host pages file (:class:`orbitkv_fs.pages.HostPages`) in the manager's ``--shm-dir``,
named after the engine id (``orbitkv-pages-<engine id>``), filled with seeded random BF16 values. It talks
to the manager only through the public client API (:func:`orbitkv_fs.client.connect`: ``register``,
``save``, ``lookup``, ``restore``, ``unregister``); whatever the data plane asks of a client reaches it that
way.

Commands (each a separate, short-lived process; the pages file is the engine's state between them):

* ``pages`` -- create the pages file (or reuse it) and print the registration body ``POST /v1/engines``
  takes (what a connector sends over REST), for curl.
* ``save`` -- create the pages if needed, register the engine over the data plane (unless it is already
  registered), save ``--chunks`` chunks of ``--blocks-per-chunk`` blocks each.
* ``restore`` -- zero those chunks' blocks, look them up and restore them, and compare the pages with
  what was saved (identical for exact codecs; the largest difference for lossy ones). A manager that no
  longer knows the engine (it restarted) gets its registration again first, as a connector's next call does.
* ``clean`` -- unregister the engine (if it is registered) and remove its pages file and credential.

Every data-plane call for the engine carries the credential its registration answered (docs/security.md):
``save`` keeps it next to the pages file (``orbitkv-pages-<engine id>.credential``, mode 0600), with the codec
it registered with, and the later commands present it from there.

The engine registers without a pid: the manager does not unregister it when a command exits (``clean`` or
``DELETE /v1/engines/{id}`` does). Output is deterministic for given flags (no timings), so documentation
can show it verbatim. Exit status: 0 done, 1 ``restore`` found chunks missing or ``clean`` could not
unregister (it removes the pages all the same), 2 the manager refused or could not be reached (one line on
stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

import ml_dtypes
import numpy as np

from orbitkv_fs.client import Client, connect
from orbitkv_fs.connectors.common import RestRegistrar
from orbitkv_fs.console import HelpFormatter, entry_point
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.geometry import EngineRegistration
from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, EngineBusy, UnknownEngine
from orbitkv_fs.pages import HostPages, PageTensor

PAGES_PREFIX = "orbitkv-pages-"
BF16 = np.dtype(ml_dtypes.bfloat16)


def pages_path(args: argparse.Namespace) -> str:
    return os.path.join(args.shm_dir, PAGES_PREFIX + args.engine_id)


def credential_path(args: argparse.Namespace) -> str:
    """Where ``save`` keeps the credential its registration answered, for the commands run after it."""
    return pages_path(args) + ".credential"


def _expected(args: argparse.Namespace, t: PageTensor) -> np.ndarray:
    """The seeded content of tensor ``t`` (what ``pages`` writes, what ``restore`` compares with)."""
    rng = np.random.default_rng([args.seed, t.layer, 0 if t.role == "key" else 1])
    return rng.standard_normal(t.shape, dtype=np.float32).astype(BF16)


def open_pages(args: argparse.Namespace) -> tuple[HostPages, bool]:
    """The engine's pages file, created and filled when missing; ``(pages, created)``. Raises
    :class:`OrbitKVError` when a file of that name holds another geometry."""
    path = pages_path(args)
    shape = [args.blocks, args.block_size, args.heads, args.head_dim]
    want = [PageTensor(f"L{layer}.{role}", 0, shape, [], "bfloat16", role, layer, "separate")
            for layer in range(args.layers) for role in ("key", "value")]
    if os.path.exists(path):
        pages = HostPages.open(path)
        if [(t.name, t.shape, t.dtype) for t in pages.tensors.values()] != [(t.name, t.shape, t.dtype) for t in want]:
            pages.close()
            raise OrbitKVError(f"{path} holds other tensors than these flags ask for; "
                               f"run `orbitkv-sample-engine clean --engine-id {args.engine_id}` first")
        return pages, False
    pages = HostPages.create(want, path=path)
    for t in pages.tensors.values():
        pages.array(t.name)[...] = _expected(args, t)
    return pages, True


def registration(args: argparse.Namespace, pages: HostPages) -> EngineRegistration:
    return EngineRegistration(model=args.model, num_layers=args.layers, layer_start=0, layer_end=args.layers,
                              block_size=args.block_size, num_heads=args.heads, head_dim=args.head_dim,
                              dtype="bfloat16", tensors=[pages.descriptor(name) for name in pages.tensors],
                              engine_kind="sample", codec=args.codec, engine_id=args.engine_id)


def chunks(args: argparse.Namespace) -> list[ChunkBlocks]:
    per = args.blocks_per_chunk
    return [ChunkBlocks(chunk_key(f"{args.engine_id}/prompt-{i}"), list(range(i * per, (i + 1) * per)))
            for i in range(args.chunks)]


def _connect(args: argparse.Namespace) -> Client:
    client = connect(args.data_plane, timeout=args.timeout)
    try:
        with open(credential_path(args)) as f:
            client.set_credential(args.engine_id, f.readline().strip())
    except FileNotFoundError:  # not registered by ``save`` (yet): calls go without one
        pass
    return client


def _keep_credential(args: argparse.Namespace, credential: str, codec: str) -> None:
    """The credential a registration answered, and the codec it registered with (an engine's namespace
    depends on its codec: registering again after a manager restart must name the same one)."""
    fd = os.open(credential_path(args), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{credential}\n{codec}\n")


def _registered_codec(args: argparse.Namespace) -> str | None:
    """The codec ``save`` registered with (None: no record of it)."""
    try:
        with open(credential_path(args)) as f:
            return f.read().split("\n")[1] or None
    except (FileNotFoundError, IndexError):
        return None


def cmd_pages(args: argparse.Namespace) -> int:
    pages, created = open_pages(args)
    try:
        body = json.dumps(RestRegistrar.body(registration(args, pages)))
    finally:
        pages.close(unlink=False)
    if args.out:
        with open(args.out, "w") as f:
            f.write(body + "\n")
    else:
        print(body)
    print(f"{'created' if created else 'kept'} {pages_path(args)}: {args.layers} layers x {args.blocks} blocks "
          f"of {args.block_size} tokens, K and V, bfloat16", file=sys.stderr)
    return 0


def cmd_save(args: argparse.Namespace) -> int:
    pages, _ = open_pages(args)
    try:
        with _connect(args) as client:
            try:
                info = client.register(registration(args, pages))
                _keep_credential(args, info.credential, info.codec)
                print(f"registered {info.engine_id}: namespace {info.namespace}, codec {info.codec}, "
                      f"{info.num_blocks} blocks, {info.segments_per_chunk} segments per chunk")
            except EngineBusy:
                print(f"{args.engine_id} is registered already")
            r = client.save(args.engine_id, chunks(args))
    finally:
        pages.close(unlink=False)
    raw = "".join(f", {n} raw ({why})" for why, n in sorted(r.raw_segments.items()))
    print(f"saved {r.chunks_saved} chunks ({r.chunks_present} present already): {r.segments} segments, "
          f"{r.logical_bytes} bytes, {r.stored_bytes} stored{raw}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    pages, _ = open_pages(args)
    todo = chunks(args)
    blocks = [b for c in todo for b in c.blocks]
    try:
        for t in pages.tensors.values():
            pages.array(t.name)[blocks] = 0
        with _connect(args) as client:
            try:
                lk = client.lookup(args.engine_id, [c.key for c in todo])
            except UnknownEngine:  # the manager restarted and forgot it: register again, as a connector does
                args.codec = args.codec or _registered_codec(args)
                info = client.register(registration(args, pages))
                _keep_credential(args, info.credential, info.codec)
                print(f"registered {info.engine_id} again: namespace {info.namespace}, codec {info.codec}")
                lk = client.lookup(args.engine_id, [c.key for c in todo])
            print(f"looked up {len(todo)} chunks: {lk.count} present (DRAM {lk.dram}, lower tier {lk.lower}, "
                  f"peers {lk.peer})")
            r = client.restore(args.engine_id, todo[:lk.count], lease_id=lk.lease_id)
        worst = 0.0
        for t in pages.tensors.values():
            got = pages.array(t.name)[blocks].astype(np.float32)
            worst = max(worst, float(np.abs(got - _expected(args, t)[blocks].astype(np.float32)).max()))
    finally:
        pages.close(unlink=False)
    same = "identical to what was saved" if worst == 0 else f"largest difference from what was saved {worst:g}"
    print(f"restored {sum(r.restored)} chunks: {r.segments} segments, {r.logical_bytes} bytes; {same}")
    return 0 if lk.count == len(todo) and all(r.restored) else 1


def cmd_clean(args: argparse.Namespace) -> int:
    rc = 0
    try:
        with _connect(args) as client:
            client.unregister(args.engine_id)
        print(f"unregistered {args.engine_id}")
    except UnknownEngine:
        pass
    except OrbitKVError as e:  # no manager to ask: its pages go all the same (a gone manager maps nothing)
        print(f"orbitkv-sample-engine clean: {args.engine_id} not unregistered: {e}", file=sys.stderr)
        rc = 1
    if os.path.exists(credential_path(args)):
        os.unlink(credential_path(args))
    path = pages_path(args)
    if os.path.exists(path):
        os.unlink(path)
        print(f"removed {path}")
    return rc


COMMANDS = {"pages": (cmd_pages, "create the pages file and print the REST registration body"),
            "save": (cmd_save, "register (over the data plane) and save chunks"),
            "restore": (cmd_restore, "look the chunks up, restore them and compare"),
            "clean": (cmd_clean, "unregister the engine and remove its pages file and credential")}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)
    g = common.add_argument_group("the engine")
    g.add_argument("--engine-id", default="sample-tp0", help="engine id (also names the pages file)")
    g.add_argument("--data-plane", default="tcp://127.0.0.1:9092", help="the manager's --data-plane")
    g.add_argument("--shm-dir", default="/dev/shm", help="the manager's --shm-dir (the pages file goes there)")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the manager's answers")
    g.add_argument("--codec", default=None,
                   help="codec the engine registers with (default: the manager's --storage-codec)")
    g.add_argument("--model", default="orbitkv-sample", help="model name (part of the namespace)")
    g.add_argument("--layers", type=int, default=4, help="layers, each with a K and a V tensor")
    g.add_argument("--blocks", type=int, default=64, help="blocks per tensor")
    g.add_argument("--block-size", type=int, default=16, help="tokens per block")
    g.add_argument("--heads", type=int, default=2, help="KV heads")
    g.add_argument("--head-dim", type=int, default=64, help="head dimension")
    g.add_argument("--seed", type=int, default=0, help="seed of the pages' random BF16 content")
    g.add_argument("--chunks", type=int, default=4, help="chunks saved and restored")
    g.add_argument("--blocks-per-chunk", type=int, default=2, help="blocks of one chunk")
    p = argparse.ArgumentParser(prog="orbitkv-sample-engine", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_) in COMMANDS.items():
        sp = sub.add_parser(name, parents=[common], help=help_, description=help_, formatter_class=HelpFormatter)
        if name == "pages":
            sp.add_argument("--out", default=None, help="write the body to this file (default: stdout)")
    return p


@entry_point("orbitkv-sample-engine")
def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.layers, args.blocks, args.block_size, args.heads, args.head_dim, args.chunks,
           args.blocks_per_chunk) < 1:
        p.error("geometry, --chunks and --blocks-per-chunk must be positive")
    if args.chunks * args.blocks_per_chunk > args.blocks:
        p.error(f"--chunks x --blocks-per-chunk ({args.chunks * args.blocks_per_chunk}) exceeds --blocks "
                f"({args.blocks})")
    try:
        return COMMANDS[args.cmd][0](args)
    except OrbitKVError as e:
        sys.stdout.flush()  # what the command printed before it failed comes first, as on a terminal
        print(f"orbitkv-sample-engine {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
