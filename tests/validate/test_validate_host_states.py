"""validate with host-resident states (pinned memory, transfers overlapped with compute: model/host_states.py)
measures exactly what it measures with the states on the GPU: every stream, the drift between them, the logits."""

from __future__ import annotations

import pytest

from kimi_nvfp4.validate import validate_checkpoint


@pytest.mark.gpu
def test_host_states_give_the_same_report(calibrated_pair, tmp_path, cuda_device):
    src, out = calibrated_pair
    reports = {
        where: validate_checkpoint(out, src, "sample", report_dir=tmp_path / where, samples=3, seq_len=40,
                                   device="cuda", states_device=where, max_chunk_tokens=24, baseline=True,
                                   progress=False, record_in_manifest=False)
        for where in ("cuda", "cpu")
    }
    gpu, host = reports["cuda"], reports["cpu"]
    assert [x.model_dump() for x in gpu.layers] == [x.model_dump() for x in host.layers]
    assert [x.model_dump() for x in gpu.end_to_end] == [x.model_dump() for x in host.end_to_end]
