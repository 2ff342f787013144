"""The torchvision stand-in, in a child process (it changes sys.modules for good)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from kimi_nvfp4.engine_check.torchvision_standin import (
        TorchvisionUnavailable, install_torchvision_standin, torchvision_import_error,
    )
    import sys
    if torchvision_import_error() is None:
        print("REAL")  # a working torchvision: the stand-in is never installed by ensure_torchvision
        sys.exit(0)
    install_torchvision_standin()
    import torchvision.transforms as T
    from torchvision.transforms.functional import InterpolationMode
    import torchvision.transforms.v2.functional as tvF
    from transformers.utils.import_utils import is_torchvision_available
    assert InterpolationMode.BICUBIC.value == "bicubic" and T.InterpolationMode is InterpolationMode
    assert not is_torchvision_available()  # transformers never routes its image work to the stand-in
    try:
        T.Compose([])
    except TorchvisionUnavailable as e:
        assert "torchvision.transforms.Compose" in str(e)
        print("STANDIN")
    """
)


def test_standin_imports_keep_interpolation_mode_and_refuse_transforms():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    assert out.strip() in ("STANDIN", "REAL")
