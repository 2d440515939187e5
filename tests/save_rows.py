"""Save batches written as ``(chunk, segment, key)`` items, as the save pipeline holds them: :class:`SaveRows`."""

from __future__ import annotations

import numpy as np

from orbitkv_fs.manager.save import SaveRows


def rows_of(items: list, segs: list) -> SaveRows:
    """The :class:`SaveRows` of ``items``, a run per stretch of one chunk object (as the save cuts them)."""
    index = {id(s): i for i, s in enumerate(segs)}
    runs: list[tuple] = []
    for ch, seg, key in items:
        if not runs or runs[-1][0] is not ch:
            runs.append((ch, [], []))
        runs[-1][1].append(index[id(seg)])
        runs[-1][2].append(key)
    return SaveRows.join([((ch, np.asarray(si, dtype=np.int64), keys), 0, len(keys)) for ch, si, keys in runs])
