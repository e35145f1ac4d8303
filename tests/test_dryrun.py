"""The dry run of a weight-loading function: slices and destinations learnt from stand-ins, nothing
copied; what it cannot predict is named, with the reason."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from streamload.dryrun import Unpredictable, dry_run
from streamload.shard import Slice

Pairs = Iterable[tuple[str, torch.Tensor]]


def test_narrows_become_slices_and_copies_are_not_made() -> None:
    qkv = torch.zeros(12, 8)  # a fused parameter: q rows 0-3, k rows 4-7, v rows 8-11
    down = torch.zeros(8, 3)

    def load(pairs: Pairs) -> set[str]:
        seen = set()
        for name, t in pairs:
            if name == "down":  # a row-parallel weight: this rank keeps columns 3..5 of 6
                down.copy_(t.narrow(1, 3, 3))
            else:
                at = {"q": 0, "k": 4, "v": 8}[name]
                qkv.narrow(0, at, 4).copy_(t.narrow(0, 4, 4).narrow(0, 0, 4))  # rank 1 of 2, two narrows
            seen.add(name)
        return seen

    tensors = {n: ((8, 8), torch.bfloat16) for n in "qkv"} | {"down": ((8, 6), torch.bfloat16)}
    learned, result = dry_run(load, tensors)
    assert result == {"q", "k", "v", "down"}
    assert not learned.whole and not learned.unused
    assert learned.copies["k"].part == Slice(0, 4, 4)
    assert learned.copies["down"].part == Slice(1, 3, 3)
    dest = learned.copies["v"].dest  # a view of the parameter, at v's rows
    assert dest.data_ptr() == qkv[8:].data_ptr() and dest.shape == (4, 8)
    assert learned.copies["down"].dest is down
    assert not qkv.any() and not down.any()  # nothing was copied


def test_whole_tensors_reshapes_and_unused_names() -> None:
    norm, scale = torch.zeros(8), torch.zeros(1)

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "norm":
                norm.copy_(t.to(torch.bfloat16).contiguous())
            elif name == "scale":
                scale.copy_(t.reshape(1))  # a 0-d checkpoint value into a [1] parameter
            # "rotary.inv_freq": skipped without a look

    learned, _ = dry_run(
        load, {"norm": ((8,), torch.bfloat16), "scale": ((), torch.float32), "rotary.inv_freq": ((4,), torch.float32)}
    )
    assert learned.copies["norm"].part is None and learned.copies["norm"].dest is norm
    assert learned.copies["scale"].part is None and learned.copies["scale"].dest.shape == ()
    assert learned.unused == {"rotary.inv_freq"}


def test_what_cannot_be_predicted_is_read_whole_with_a_reason() -> None:
    a, b, c, d = (torch.zeros(4, 4) for _ in range(4))

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "transposed":
                a.copy_(t.t())
            elif name == "twice":
                b.copy_(t)
                c.copy_(t)
            elif name == "both-dims":
                d[:2, :2].copy_(t.narrow(0, 0, 2).narrow(1, 2, 2))
            elif name == "looked-at":
                assert t.shape == (4, 4)

    names = ("transposed", "twice", "both-dims", "looked-at")
    learned, _ = dry_run(load, dict.fromkeys(names, ((4, 4), torch.float32)))
    assert not learned.copies and set(learned.whole) == set(names)
    assert learned.whole["transposed"] == "t"
    assert learned.whole["twice"] == "copied 2 times"
    assert "one dimension" in learned.whole["both-dims"]
    assert learned.whole["looked-at"] == "looked at but never copied"


def test_values_asked_for_stop_the_dry_run() -> None:
    def load(pairs: Pairs) -> None:
        for _, t in pairs:
            float(t.sum().item())

    with pytest.raises(Unpredictable, match=r"item\(\) of 'x'"):
        dry_run(load, {"x": ((2,), torch.float32)})
    # and the stand-ins stop recording once the dry run is over
    learned, kept = dry_run(lambda pairs: list(pairs), {"y": ((2,), torch.float32)})
    assert learned.unused == {"y"}
    assert kept[0][1].shape == (2,) and (kept[0][1] + 1).is_meta


def test_size_one_dimensions_and_unbind_keep_track_of_the_slice() -> None:
    experts = torch.zeros(4, 6, 8)  # a fused MoE parameter: [expert, rows, cols]

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            expert = int(name[-1])
            (one,) = t.unsqueeze(0).unbind()  # as vLLM's FusedMoE does with a single expert's weight
            experts.data[expert].narrow(0, 3, 3).copy_(one.narrow(0, 3, 3))  # rank 1's rows

    learned, _ = dry_run(load, {f"e{i}": ((6, 8), torch.float16) for i in range(4)})
    assert learned.copies["e2"].part == Slice(0, 3, 3)
    assert learned.copies["e2"].dest.data_ptr() == experts[2, 3:].data_ptr()


def test_a_parameter_changed_after_its_copy_is_loaded_by_the_model() -> None:
    """`param.copy_(fn(param))` after the copy (vLLM's composed loaders, Mamba's A = -exp(A_log)): the
    stream cannot write first and leave `fn` undone, so the tensor goes to the real function; writes
    beside a copy (a vocabulary's padding rows zeroed) do not count."""
    a_log, vocab = torch.zeros(4), torch.zeros(8, 2)

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "A_log":
                a_log.copy_(t)
                a_log.copy_(-torch.exp(a_log))
            else:
                vocab[:6].copy_(t)
                vocab[6:].fill_(0)

    learned, _ = dry_run(load, {"A_log": ((4,), torch.float32), "embed": ((6, 2), torch.float32)})
    assert learned.whole == {"A_log": "its parameter is written again after the copy"}
    assert learned.copies["embed"].part is None and learned.copies["embed"].dest.shape == (6, 2)


def test_transposes_reinterpretations_and_ops_after_an_unpredictable_one() -> None:
    w, u, v = torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.int16), torch.zeros(2, 4)

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "T":
                w.copy_(t.T)  # a property, not the same values
            elif name == "bits":
                u.copy_(t.view(torch.int16))  # the same bytes as another dtype: no conversion would match
            else:
                v.copy_(t.float().narrow(0, 0, 2))  # tainted, then narrowed: still just unpredictable

    learned, _ = dry_run(
        load, {"T": ((2, 4), torch.float32), "bits": ((4, 2), torch.float16), "after": ((4, 4), torch.bfloat16)}
    )
    assert not learned.copies
    assert learned.whole["T"] == "property" and learned.whole["bits"] == "view" and learned.whole["after"] == "float"
