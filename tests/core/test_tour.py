"""`make demo` (python -m keyfold tour): every variant and the decoding rows pass the rule."""

import torch

from keyfold import tour


def test_tour_runs_every_variant_and_decoding_by_the_rule(capsys):
    assert tour.main(["-N", "256", "-H", "2", "-D", "16", "--repeats", "1", "--decode-tokens", "512"]) == 0
    out = capsys.readouterr().out
    for name, _, _ in tour.variants(256, 2):
        assert name in out
    assert "FAIL" not in out and out.count(" ok") == len(tour.variants(256, 2)) + 3


def test_decoding_rows_name_the_kernel_and_check_the_rule():
    lines, failures = tour._decode_rows(H=2, D=16, tokens=300, repeats=1)
    assert failures == 0 and len(lines) == 3
    for line, dtype in zip(lines, (torch.float32, torch.bfloat16, torch.float16)):
        assert str(dtype).replace("torch.", "") in line and line.split()[3] in ("op", "native")
