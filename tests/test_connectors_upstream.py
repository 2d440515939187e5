"""Our vLLM connector and SGLang backend against the REAL upstream base classes, read from PyPI wheels.

vllm and sglang are never installed here (they would pull CUDA torch). The test downloads the wheels
(``pip download --no-deps``, cached in ``$ORBITKV_WHEEL_CACHE`` or the temp dir), reads the base-class
sources out of them and checks with :mod:`ast` that:

* every abstract method of ``KVConnectorBase_V1`` / ``HiCacheStorage`` is implemented by our class, and
  every method we define that the base also defines keeps a compatible signature (same parameter names
  in order, defaults where the base has them, ``*args``/``**kwargs`` where the base has them, same
  static/class-method kind);
* our guarded ``from vllm... import X`` / ``from sglang... import X`` lines name modules and names that
  exist in the wheel;
* the constructors match what the engines' factories call (vLLM: a ``kv_cache_config`` parameter;
  SGLang's dynamic backend: ``backend_class(storage_config, kwargs)``).

Skipped, with the reason, only when the package registry cannot be reached.
"""

from __future__ import annotations

import ast
import glob
import os
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

import orbitkv_fs.connectors.sglang as our_sglang
import orbitkv_fs.connectors.vllm as our_vllm

CACHE = Path(os.environ.get("ORBITKV_WHEEL_CACHE") or Path(tempfile.gettempdir()) / "orbitkv-upstream-wheels")

VLLM = ("vllm", "vllm==0.34.*", "vllm-0.34.*.whl")
SGLANG = ("sglang", "sglang>=0.5.20,<0.5.30", "sglang-0.5.2[0-9]*.whl")


def _registry_host() -> tuple[str, int]:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    u = urlparse(url)
    return u.hostname or "pypi.org", u.port or (443 if u.scheme == "https" else 80)


def _wheel(name: str, spec: str, pattern: str) -> zipfile.ZipFile:
    found = sorted(glob.glob(str(CACHE / pattern)))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", spec, "-d", str(CACHE)],
                              capture_output=True, text=True, timeout=1800)
        found = sorted(glob.glob(str(CACHE / pattern)))
        if proc.returncode != 0 or not found:
            host, port = _registry_host()
            try:
                socket.create_connection((host, port), timeout=5).close()
            except OSError as e:
                pytest.skip(f"package registry {host}:{port} unreachable ({e}); cannot fetch {spec}")
            pytest.fail(f"pip download {spec} failed although the registry is reachable:\n{proc.stderr[-2000:]}")
    return zipfile.ZipFile(found[-1])


@pytest.fixture(scope="module")
def vllm_wheel() -> zipfile.ZipFile:
    return _wheel(*VLLM)


@pytest.fixture(scope="module")
def sglang_wheel() -> zipfile.ZipFile:
    return _wheel(*SGLANG)


# --------------------------------------------------------------------------------------------- ast helpers


@dataclass
class Method:
    node: ast.FunctionDef
    abstract: bool
    kind: str  # "instance" | "classmethod" | "staticmethod" | "property"


def _decorators(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        if isinstance(d, ast.Name):
            names.add(d.id)
        elif isinstance(d, ast.Attribute):
            names.add(d.attr)
    return names


def _methods(cls: ast.ClassDef) -> dict[str, Method]:
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decs = _decorators(node)
            kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decs), "instance")
            out[node.name] = Method(node, "abstractmethod" in decs, kind)
    return out


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def _source(wheel: zipfile.ZipFile, module: str) -> str | None:
    base = module.replace(".", "/")
    for cand in (base + ".py", base + "/__init__.py"):
        try:
            return wheel.read(cand).decode()
        except KeyError:
            continue
    return None


def _defines(wheel: zipfile.ZipFile, module: str, name: str) -> bool:
    src = _source(wheel, module)
    if src is None:
        return False
    tree = ast.parse(src)
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


def _signature_problems(base: Method, ours: Method) -> list[str]:
    """Ways ``ours`` cannot stand in for ``base`` for a caller written against the base."""
    problems = []
    if base.kind != ours.kind:
        problems.append(f"is a {ours.kind}, the base's is a {base.kind}")
    b, o = base.node.args, ours.node.args
    b_pos = [a.arg for a in b.posonlyargs + b.args]
    o_pos = [a.arg for a in o.posonlyargs + o.args]
    if o_pos[: len(b_pos)] != b_pos:
        problems.append(f"positional parameters {o_pos} do not start with the base's {b_pos}")
    extra = o_pos[len(b_pos):]
    n_o_defaults = len(o.defaults)
    required_ours = o_pos[: len(o_pos) - n_o_defaults]
    if any(p in required_ours for p in extra):
        problems.append(f"adds required parameters {[p for p in extra if p in required_ours]}")
    b_defaulted = b_pos[len(b_pos) - len(b.defaults):] if b.defaults else []
    missing_defaults = [p for p in b_defaulted if p in required_ours]
    if missing_defaults:
        problems.append(f"parameters {missing_defaults} lost their defaults")
    if b.vararg and not o.vararg:
        problems.append("lacks *args")
    if b.kwarg and not o.kwarg:
        problems.append("lacks **kwargs")
    o_kwonly = {a.arg: d for a, d in zip(o.kwonlyargs, o.kw_defaults)}
    for a in b.kwonlyargs:
        if a.arg not in o_kwonly and not o.kwarg:
            problems.append(f"lacks keyword-only parameter {a.arg}")
    for a, d in zip(o.kwonlyargs, o.kw_defaults):
        if d is None and a.arg not in {x.arg for x in b.kwonlyargs}:
            problems.append(f"adds required keyword-only parameter {a.arg}")
    return problems


def _check_class(base_cls: ast.ClassDef, our_cls: ast.ClassDef, *, inherited: dict[str, Method] | None = None) -> None:
    base = dict(inherited or {})
    base.update(_methods(base_cls))
    ours = _methods(our_cls)
    abstract = sorted(n for n, m in base.items() if m.abstract)
    assert abstract, "the upstream base class has no abstract methods: the test reads the wrong file"
    missing = [n for n in abstract if n not in ours]
    assert not missing, f"{our_cls.name} does not implement abstract {missing} of {base_cls.name}"
    problems = {n: p for n in sorted(set(ours) & set(base)) if n != "__init__"
                for p in [_signature_problems(base[n], ours[n])] if p}
    assert not problems, f"{our_cls.name} overrides incompatibly: {problems}"


def _guarded_imports(tree: ast.Module, package: str) -> list[tuple[str, str]]:
    return [(node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module and node.module.split(".")[0] == package for a in node.names]


def _our_tree(module) -> ast.Module:
    return ast.parse(Path(module.__file__).read_text())


# --------------------------------------------------------------------------------------------------- vLLM


def test_vllm_connector_implements_the_real_kv_connector_base(vllm_wheel: zipfile.ZipFile) -> None:
    base_src = _source(vllm_wheel, "vllm.distributed.kv_transfer.kv_connector.v1.base")
    assert base_src is not None
    base_tree = ast.parse(base_src)
    ours = _our_tree(our_vllm)
    our_cls = _class(ours, "OrbitKVConnector")
    assert [ast.unparse(b) for b in our_cls.bases] == ["KVConnectorBase_V1"]
    _check_class(_class(base_tree, "KVConnectorBase_V1"), our_cls)
    # The scheduler-side and worker-side methods the issue names are all ours, not inherited defaults.
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "build_connector_meta",
                 "register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                 "get_finished", "get_block_ids_with_load_errors"):
        assert name in _methods(our_cls), name
    # Our metadata subclasses the real metadata base.
    meta = _class(ours, "OrbitKVConnectorMetadata")
    assert [ast.unparse(b) for b in meta.bases] == ["KVConnectorMetadata"]


def test_vllm_constructor_matches_the_factory(vllm_wheel: zipfile.ZipFile) -> None:
    factory = _source(vllm_wheel, "vllm.distributed.kv_transfer.kv_connector.factory")
    assert 'supports_kw(connector_cls, "kv_cache_config")' in factory
    assert "connector_cls(config, role, kv_cache_config)" in factory
    assert "getattr(connector_module, connector_name)" in factory  # kv_connector names our class
    init = _methods(_class(_our_tree(our_vllm), "OrbitKVConnector"))["__init__"].node
    assert [a.arg for a in init.args.args] == ["self", "vllm_config", "role", "kv_cache_config"]
    base_init = _methods(_class(ast.parse(_source(vllm_wheel, "vllm.distributed.kv_transfer.kv_connector.v1.base")),
                                "KVConnectorBase_V1"))["__init__"].node
    assert [a.arg for a in base_init.args.args] == ["self", "vllm_config", "role", "kv_cache_config"]


def test_vllm_imported_names_exist_in_the_wheel(vllm_wheel: zipfile.ZipFile) -> None:
    imports = _guarded_imports(_our_tree(our_vllm), "vllm")
    assert ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1") in imports
    missing = [f"{m}.{n}" for m, n in imports if not _defines(vllm_wheel, m, n)]
    assert not missing, f"names we import that {VLLM[1]} does not define: {missing}"


def test_vllm_config_fields_we_read_exist(vllm_wheel: zipfile.ZipFile) -> None:
    src = _source(vllm_wheel, "vllm.config.kv_transfer")
    for field in ("kv_connector_extra_config", "kv_connector_module_path"):
        assert field in src
    cache = _source(vllm_wheel, "vllm.config.cache")
    assert "block_size" in cache
    parallel = _source(vllm_wheel, "vllm.config.parallel")
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "rank"):
        assert field in parallel
    out = _source(vllm_wheel, "vllm.v1.core.sched.output")
    # resumed_req_ids is read where present (up to 0.33): from 0.34 a resumed request comes as a new one.
    for field in ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "new_block_ids",
                  "num_computed_tokens", "block_ids", "prompt_token_ids"):
        assert field in out, field


def test_vllm_keeps_its_kv_cache_exportable_through_legacy_cuda_ipc_for_us(vllm_wheel: zipfile.ZipFile,
                                                                         monkeypatch) -> None:
    """vLLM 0.34 maps its GPU KV cache with the driver's virtual memory calls by default (the extensible KV
    cache), which legacy CUDA IPC, the Manager's import, cannot export. Our connector's ``kv_cache_access``,
    run against the wheel's own ``KVCacheAccess``, answers ``LEGACY_IPC`` (``IN_PROCESS`` when the KV only
    goes through staging pages), and the wheel's config turns the extensible KV cache off on that flag."""
    src = _source(vllm_wheel, "vllm.config.kv_transfer")
    tree = ast.parse(src)
    enum_src = ast.get_source_segment(src, _class(tree, "KVCacheAccess"))
    ns: dict = {}
    exec("import enum\n" + enum_src, ns)
    access = ns["KVCacheAccess"]
    module = type(sys)("vllm.config.kv_transfer")
    module.KVCacheAccess = access
    for name in ("vllm", "vllm.config"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or type(sys)(name))
    monkeypatch.setitem(sys.modules, "vllm.config.kv_transfer", module)
    from types import SimpleNamespace

    def ktc(**extra):
        return SimpleNamespace(kv_connector_extra_config=extra)

    cls = our_vllm.OrbitKVConnector
    assert cls.kv_cache_access(ktc()) is access.LEGACY_IPC
    assert cls.kv_cache_access(ktc(**{"orbitkv.staging": "auto"})) is access.LEGACY_IPC
    assert cls.kv_cache_access(ktc(**{"orbitkv.staging": "always"})) is access.IN_PROCESS
    decision = _source(vllm_wheel, "vllm.config.vllm")
    assert "elif KVCacheAccess.LEGACY_IPC in kv_cache_access:" in decision
    assert "cannot export driver-mapped memory" in decision


# ------------------------------------------------------------------------------------------------- SGLang


def test_sglang_backend_implements_the_real_hicache_storage(sglang_wheel: zipfile.ZipFile) -> None:
    src = _source(sglang_wheel, "sglang.srt.mem_cache.hicache_storage")
    assert src is not None
    our_cls = _class(_our_tree(our_sglang), "OrbitKVHiCacheStorage")
    assert [ast.unparse(b) for b in our_cls.bases] == ["HiCacheStorage"]
    _check_class(_class(ast.parse(src), "HiCacheStorage"), our_cls)
    for name in ("register_mem_pool_host", "batch_exists", "batch_get_v1", "batch_set_v1", "get", "set",
                 "batch_get", "batch_set", "exists"):
        assert name in _methods(our_cls), name


def test_sglang_dynamic_backend_factory_builds_ours(sglang_wheel: zipfile.ZipFile) -> None:
    factory = _source(sglang_wheel, "sglang.srt.mem_cache.storage.backend_factory")
    assert "backend_class(storage_config, kwargs)" in factory
    assert 'required_fields = ["backend_name", "module_path", "class_name"]' in factory
    assert "issubclass(backend_class, HiCacheStorage)" in factory
    controller = _source(sglang_wheel, "sglang.srt.managers.cache_controller")
    assert 'extra_config.get("interface_v1", 0)' in controller  # how our zero-copy path is selected
    init = _methods(_class(_our_tree(our_sglang), "OrbitKVHiCacheStorage"))["__init__"].node
    pos = [a.arg for a in init.args.args]
    required = pos[: len(pos) - len(init.args.defaults)]
    assert required == ["self", "storage_config"] and len(pos) >= 3


def test_sglang_imported_names_exist_in_the_wheel(sglang_wheel: zipfile.ZipFile) -> None:
    imports = _guarded_imports(_our_tree(our_sglang), "sglang")
    assert ("sglang.srt.mem_cache.hicache_storage", "HiCacheStorage") in imports
    missing = [f"{m}.{n}" for m, n in imports if not _defines(sglang_wheel, m, n)]
    assert not missing, f"names we import that SGLang does not define: {missing}"


def test_sglang_host_pool_layouts_we_read(sglang_wheel: zipfile.ZipFile) -> None:
    """The MHA host pool's buffer shapes are the ones :func:`page_view` indexes."""
    src = _source(sglang_wheel, "sglang.srt.mem_cache.pool_host.mha")
    assert src is not None
    for dims in ("dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)",
                 "dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)"):
        assert dims in src, dims
    flat = " ".join(src.split())
    assert "2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim," in flat
    assert "2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim," in flat


def test_what_changes_kv_is_read_where_vllm_reads_it(vllm_wheel: zipfile.ZipFile) -> None:
    """The request fields :func:`request_inputs` reads are the ones vLLM's block hashes mix in, and the K/V
    split of every backend :func:`vllm_backend_split` knows is the one its source uses."""
    utils = " ".join((_source(vllm_wheel, "vllm.v1.core.kv_cache_utils") or "").split())
    for needle in ('[("lora", lora_request.lora_name, lora_request.lora_path)]',
                   '("cache_salt", request.cache_salt)', "request.mm_features", "mm_feature.identifier",
                   "mm_feature.mm_position.offset", "request.prompt_embeds is None"):
        assert needle in utils, needle
    req = _source(vllm_wheel, "vllm.v1.request") or ""
    for attr in ("self.lora_request =", "self.cache_salt", "self.mm_features =", "self.prompt_embeds ="):
        assert attr in req, attr
    from orbitkv_fs.connectors.staging import KVSplit, _VLLM_SPLITS

    split_of = {KVSplit.CONTENT: "split(self.head_size, dim=-1)", KVSplit.TOKEN: "kv_cache.chunk(2, dim=2)"}
    modules = {"FLASH_ATTN": "flash_attn", "FLASHINFER": "flashinfer", "TRITON_ATTN": "triton_attn",
               "FLEX_ATTENTION": "flex_attention", "CPU_ATTN": "cpu_attn"}
    assert set(modules) == set(_VLLM_SPLITS)
    for name, module in modules.items():
        src = _source(vllm_wheel, f"vllm.v1.attention.backends.{module}") or ""
        assert f'return "{name}"' in src, name
        want = split_of[_VLLM_SPLITS[name]]
        assert want in src or want.replace("self.head_size", "hs") in src, (name, want)
    cpu = " ".join((_source(vllm_wheel, "vllm.v1.attention.backends.cpu_attn") or "").split())
    assert "kv_cache = kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in cpu


def test_sglang_storage_hashes_carry_lora_and_cache_salt(sglang_wheel: zipfile.ZipFile) -> None:
    """The page hashes SGLang hands its storage backend are seeded with the request's ``extra_key`` (which
    holds the LoRA id) and ``cache_salt``: our backend keys those hashes, so namespaces stay apart."""
    utils = " ".join((_source(sglang_wheel, "sglang.srt.mem_cache.utils") or "").split())
    assert 'storage_namespace_seed( getattr(key, "extra_key", None), getattr(key, "cache_salt", None) )' in utils
    batch = " ".join((_source(sglang_wheel, "sglang.srt.managers.schedule_batch") or "").split())
    assert "extra_key = ( extra_key or \"\" ) + lora_id" in batch
    ctl = _source(sglang_wheel, "sglang.srt.managers.cache_controller") or ""
    assert "get_storage_hash_str(" in ctl


# ------------------------------------------------------------------------------------- the checker itself


def test_checker_rejects_incompatible_overrides() -> None:
    """The signature check must be able to fail."""
    base = ast.parse("class B:\n  @abstractmethod\n  def f(self, a, b=1, **kw): ...\n  def g(self, x): ...\n")
    good = ast.parse("class C(B):\n  def f(self, a, b=2, c=3, **kw): ...\n")
    _check_class(_class(base, "B"), _class(good, "C"))
    for bad in ("class C(B):\n  def g(self, x): ...\n",            # abstract f missing
                "class C(B):\n  def f(self, a, b, **kw): ...\n",    # lost default
                "class C(B):\n  def f(self, a, b=1): ...\n",        # lost **kwargs
                "class C(B):\n  def f(self, x, b=1, **kw): ...\n",  # renamed parameter
                "class C(B):\n  def f(self, a, b=1, *, c, **kw): ...\n",  # new required kw-only
                "class C(B):\n  @staticmethod\n  def f(a, b=1, **kw): ...\n"):
        with pytest.raises(AssertionError):
            _check_class(_class(base, "B"), _class(ast.parse(bad), "C"))
