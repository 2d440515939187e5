"""../2026-12-03-early-batch/timeline.py with the restore's prefix steps wrapped too: its lease and size checks,
the early first batch, each rows batch's submit and end, the engine's decode submit and block scatter. Usage and
output as there: python timeline.py OUT [--keep N] -- <orbitkv-bench pipeline arguments>"""

from __future__ import annotations

import importlib.util
import os
import sys

_spec = importlib.util.spec_from_file_location(
    "early_batch_timeline", os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                         "2026-12-03-early-batch", "timeline.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)  # type: ignore[union-attr]
_install = base.install


def install() -> None:
    _install()
    R, E = base.R, base.E
    for cls, name in ((R.RestorePipeline, "_acquire"), (R.RestorePipeline, "_check_device_batch"),
                      (R.RestorePipeline, "_start_early"), (R.RestorePipeline, "_rows_submit"),
                      (R.RestorePipeline, "_rows_end"), (E.GpuCodecEngine, "decode_columns_submit"),
                      (E.GpuCodecEngine, "scatter_blocks")):
        base._host_wrap(cls, name, name)


base.install = install  # what base.main calls

if __name__ == "__main__":
    sys.exit(base.main())
