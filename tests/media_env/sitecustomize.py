"""Lets torchvision's Python half import beside a CPU torch, for the media tests.

PyPI's torchvision for this torch is a CUDA build: its compiled ops (`torchvision::nms`,
`roi_align`, ...) cannot load without CUDA's libraries, and its import then fails registering
their fake kernels. Gemma 4's image processor needs only `transforms.v2.functional` (plain
torch). On this path (`tests/media.py` puts it, and the torchvision the installer put aside,
on `PYTHONPATH`), the op names are declared with no kernel before torchvision first imports:
calling one raises; nothing is emulated.
"""

from __future__ import annotations

import importlib.abc
import sys

# every op torchvision 0.28's `_meta_registrations` registers a fake kernel for
_OPS = ("roi_align", "_roi_align_backward", "ps_roi_align", "_ps_roi_align_backward",
        "roi_pool", "_roi_pool_backward", "ps_roi_pool", "_ps_roi_pool_backward", "nms",
        "qnms", "qroi_align", "deform_conv2d", "_deform_conv2d_backward")


class _DeclareOpsFirst(importlib.abc.MetaPathFinder):
    """Declares the op names once, at torchvision's first import; finds nothing itself."""

    library = None

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name == "torchvision" and _DeclareOpsFirst.library is None:
            import torch

            lib = torch.library.Library("torchvision", "DEF")
            for op in _OPS:
                lib.define(f"{op}(Tensor x) -> Tensor")
            _DeclareOpsFirst.library = lib
        return None


sys.meta_path.insert(0, _DeclareOpsFirst())
