"""`streamload vllm-check`'s comparison, on tensors described as the engines' ranks describe them (the
engines themselves run in tests/test_vllm.py)."""

from __future__ import annotations

import torch

from streamload.integrations.vllm.check import Report, _describe, compare


def test_identical_tensors_agree_and_every_kind_of_difference_is_named() -> None:
    w, b = torch.arange(6.0).reshape(2, 3), torch.zeros(3, dtype=torch.bfloat16)
    vllm = [{"w": _describe(w), "b": _describe(b), "scale": _describe(torch.tensor(2.0))}]
    assert (
        compare(vllm, [{"w": _describe(w.clone()), "b": _describe(b.clone()), "scale": _describe(torch.tensor(2.0))}])
        == []
    )
    flipped = w.clone()
    flipped[1, 2] = -5.0
    ours = [{"w": _describe(flipped), "b": _describe(b.float()), "extra": _describe(torch.ones(1))}]
    assert compare(vllm, ours) == [
        "'b' is torch.float32[3] through streamload, torch.bfloat16[3] through vLLM",
        "'extra' only in streamload's model",
        "'scale' only in vLLM's model",
        "'w' torch.float32[2, 3]: sum 5.0 through streamload, 15.0 through vLLM; first values [0.0, 1.0, 2.0, 3.0] "
        "against [0.0, 1.0, 2.0, 3.0]",
    ]


def test_ranks_are_named_and_the_report_reads_as_one_line() -> None:
    one, other = _describe(torch.ones(2)), _describe(torch.zeros(2))
    differences = compare([{"w": one}, {"w": one}], [{"w": one}, {"w": other}])
    assert differences == [
        "rank 1: 'w' torch.float32[2]: sum 0.0 through streamload, 2.0 through vLLM; first values [0.0, 0.0] "
        "against [1.0, 1.0]"
    ]
    report = Report("m", 2, tensors=1, differences=differences)
    assert not report.ok and str(report).startswith("streamload differs from vLLM's default loader in 1 tensor(s); ")
    assert str(Report("m", 2, tensors=7)) == (
        "streamload and vLLM's default loader agree: 2 ranks, 7 tensors each, byte for byte"
    )
