"""The dry run of a weight-loading function: slices and destinations learnt from stand-ins, nothing
copied; what it cannot predict is named, with the reason."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch

from streamload.integrations.vllm.placement.dryrun import Diverged, Unpredictable, dry_run, replay
from streamload.plan.shard import Slice

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
    learned, result = dry_run(load, tensors, [qkv, down])
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
        load,
        {"norm": ((8,), torch.bfloat16), "scale": ((), torch.float32), "rotary.inv_freq": ((4,), torch.float32)},
        [norm, scale],
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

    names = ("transposed", "twice", "both-dims")
    learned, _ = dry_run(load, dict.fromkeys(names, ((4, 4), torch.float32)), [a, b, c, d])
    assert not learned.copies and set(learned.whole) == set(names)
    assert learned.whole["transposed"] == "t"
    assert learned.whole["twice"] == "copied 2 times"
    assert "one dimension" in learned.whole["both-dims"]


def test_a_tensor_never_copied_is_not_read_as_another_ranks_expert_is_not() -> None:
    """Expert parallelism: the loader views each expert, then checks which experts this rank keeps and
    returns for the others: they are unused, never read; the replay holds the real call to
    that, and a real call that uses such a tensor after all diverges."""
    fused = torch.zeros(2, 4, 3)  # this rank's two experts of four
    local = {0: None, 1: None, 2: 0, 3: 1}

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            t = t.unsqueeze(0)  # as vLLM's expert loader does, before it asks the expert map
            slot = local[int(name.split(".")[1])]
            if slot is not None:
                fused[slot].copy_(t.squeeze(0))

    shapes = {f"experts.{e}.w": ((4, 3), torch.float32) for e in range(4)}
    learned, _ = dry_run(load, shapes, [fused])
    assert learned.unused == {"experts.0.w", "experts.1.w"} and set(learned.copies) == {"experts.2.w", "experts.3.w"}
    with replay(learned, shapes, [fused]) as run:
        load((n, run.stand_in(n)) for n in shapes)
    local[0] = 0  # the real call copies an expert its dry run left alone
    with pytest.raises(Diverged), replay(learned, shapes, [fused]) as run:
        load((n, run.stand_in(n)) for n in shapes)


def test_values_asked_for_stop_the_dry_run() -> None:
    def load(pairs: Pairs) -> None:
        for _, t in pairs:
            float(t.sum().item())

    with pytest.raises(Unpredictable, match=r"item\(\) of 'x'"):
        dry_run(load, {"x": ((2,), torch.float32)}, [])
    # and the stand-ins stop recording once the dry run is over
    learned, kept = dry_run(lambda pairs: list(pairs), {"y": ((2,), torch.float32)}, [])
    assert learned.unused == {"y"}
    assert kept[0][1].shape == (2,) and (kept[0][1] + 1).is_meta


def test_size_one_dimensions_and_unbind_keep_track_of_the_slice() -> None:
    experts = torch.zeros(4, 6, 8)  # a fused MoE parameter: [expert, rows, cols]

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            expert = int(name[-1])
            (one,) = t.unsqueeze(0).unbind()  # as vLLM's FusedMoE does with a single expert's weight
            experts.data[expert].narrow(0, 3, 3).copy_(one.narrow(0, 3, 3))  # rank 1's rows

    learned, _ = dry_run(load, {f"e{i}": ((6, 8), torch.float16) for i in range(4)}, [experts])
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

    learned, _ = dry_run(load, {"A_log": ((4,), torch.float32), "embed": ((6, 2), torch.float32)}, [a_log, vocab])
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
        load,
        {"T": ((2, 4), torch.float32), "bits": ((4, 2), torch.float16), "after": ((4, 4), torch.bfloat16)},
        [w, u, v],
    )
    assert not learned.copies
    assert learned.whole["T"] == "property" and learned.whole["bits"] == "view" and learned.whole["after"] == "float"


# What the dry run cannot see through (a copy into a temporary, a parameter rebound or handed to numpy) is
# never predicted as a copy the stream could make: each tensor is read whole and given to the real function.


def test_a_copy_into_a_temporary_then_into_the_parameter_is_read_whole() -> None:
    p, q, r = torch.zeros(4), torch.zeros(3, 2), torch.zeros(3, 2)

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "via-temporary":
                tmp = torch.empty(4)
                tmp.copy_(t)
                p.copy_(tmp)
            elif name == "index-from-temporary":
                rows = torch.empty(2, 2)
                rows.copy_(t)
                q.index_copy_(0, torch.tensor([0, 2]), rows)
            else:
                r.index_copy_(0, torch.tensor([1]), t.narrow(0, 0, 1))

    shapes = {"via-temporary": ((4,), torch.float32), "index-from-temporary": ((2, 2), torch.float32)}
    learned, _ = dry_run(load, {**shapes, "index": ((2, 2), torch.float32)}, [p, q, r])
    assert not learned.copies and not r.any()  # (p and q got the temporaries: the dry run runs real code)
    assert learned.whole == {
        "via-temporary": "copied into a tensor that is not a parameter or buffer (a temporary)",
        "index-from-temporary": "copied into a tensor that is not a parameter or buffer (a temporary)",
        "index": "index_copy_ from it",
    }


def test_a_parameter_rebound_after_the_copy_is_read_whole_and_put_back() -> None:
    p, q = torch.nn.Parameter(torch.zeros(4), requires_grad=False), torch.nn.Parameter(torch.zeros(4))
    p_ptr, q_ptr = p.data_ptr(), q.data_ptr()

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "rebound":
                p.data.copy_(t)
                p.data = p.data * 2  # the parameter now lives elsewhere: the stream's bytes would be lost
            else:
                q.data = t  # the stand-in itself bound to the parameter

    learned, _ = dry_run(load, {"rebound": ((4,), torch.float32), "bound": ((4,), torch.float32)}, [p, q])
    assert not learned.copies
    assert "rebound" in learned.whole["rebound"] and "bound to a parameter" in learned.whole["bound"]
    assert (p.data_ptr(), q.data_ptr()) == (p_ptr, q_ptr) and not q.is_meta  # the dry run left them as they were


def test_a_parameter_handed_to_numpy_is_read_whole() -> None:
    p, other = torch.zeros(4), torch.zeros(4)

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name == "numpy":
                view = p.numpy()  # writes through this are unseen by torch
                p.copy_(t)
                view[0] = 5.0
            else:
                other.copy_(t)

    learned, _ = dry_run(load, {"numpy": ((4,), torch.float32), "plain": ((4,), torch.float32)}, [p, other])
    assert "numpy" in learned.whole["numpy"] and learned.copies["plain"].dest is other
    assert p[0] == 5.0 and other.sum() == 0  # the dry run's own writes are real; copies of stand-ins are not


def test_a_write_before_the_copy_is_read_whole() -> None:
    """The stream may fill a region before the loader gets to it, so a write there before the copy
    (`param.zero_(); param.copy_(t)`) would undo the stream's bytes."""
    p = torch.zeros(4)

    def load(pairs: Pairs) -> None:
        for _, t in pairs:
            p.zero_()
            p.copy_(t)

    learned, _ = dry_run(load, {"w": ((4,), torch.float32)}, [p])
    assert learned.whole == {"w": "its parameter is written before the copy (the stream may fill it first)"}


# The real call, replayed under the same watch.


def _bert_like(embed: torch.Tensor, decoder: torch.Tensor) -> Any:
    """vLLM's BertForMaskedLM pattern: the decoder is tied to the embeddings when its name is not among
    those the loader gets."""

    def load(pairs: Pairs) -> set[str]:
        loaded = set()
        for name, t in pairs:
            (embed if name == "embed" else decoder).copy_(t)
            loaded.add(name)
        if "decoder" not in loaded:
            decoder.copy_(embed)
        return loaded

    return load


def test_a_loader_that_looks_at_names_gets_them_all_in_the_replay() -> None:
    embed, decoder = torch.zeros(3, 2), torch.zeros(3, 2)
    shapes = {"embed": ((3, 2), torch.float32), "decoder": ((3, 2), torch.float32)}
    load = _bert_like(embed, decoder)
    learned, _ = dry_run(load, shapes, [embed, decoder])
    assert set(learned.copies) == {"embed", "decoder"}
    embed.fill_(1.0)  # what the stream writes in place
    decoder.fill_(2.0)
    with replay(learned, shapes, [embed, decoder]) as run:
        assert load((name, run.stand_in(name)) for name in shapes) == {"embed", "decoder"}
    assert decoder.eq(2.0).all() and embed.eq(1.0).all()  # the decoder keeps its own weights, not a copy


def test_a_replay_that_does_something_else_names_the_tensors() -> None:
    p, norm, buf = torch.zeros(4), torch.zeros(2), torch.zeros(2)
    shapes = {"w": ((4,), torch.float32), "norm": ((2,), torch.float32), "unused": ((2,), torch.float32)}
    calls = []

    def load(pairs: Pairs) -> None:
        calls.append(1)
        for name, t in pairs:
            if name == "w":
                p.copy_(t)
            elif name == "norm":
                (norm if len(calls) == 1 else buf).copy_(t)  # the second call puts it elsewhere
            elif len(calls) > 1:
                assert t.shape == (2,)  # looks at a tensor the dry run left alone
        if len(calls) > 1:
            p.mul_(2)  # and writes into a region the stream filled

    learned, _ = dry_run(load, shapes, [p, norm, buf])
    assert set(learned.copies) == {"w", "norm"} and learned.unused == {"unused"}
    with pytest.raises(Diverged) as caught, replay(learned, shapes, [p, norm, buf]) as run:
        load((name, run.stand_in(name)) for name in shapes)
    assert caught.value.names == {"norm": "copied elsewhere than its dry run predicted"}
    calls.clear()
    with pytest.raises(Diverged) as caught, replay(learned, shapes, [p, norm, buf]) as run:
        load((name, run.stand_in(name)) for name in ("w", "unused"))  # norm withheld: it would not be copied
    assert caught.value.names == {"norm": "copied 0 times, its dry run once"}


def test_a_replay_writing_into_a_filled_region_or_using_a_stand_in_otherwise() -> None:
    p = torch.zeros(4)
    shapes = {"w": ((4,), torch.float32)}
    learned, _ = dry_run(lambda pairs: [p.copy_(t) for _, t in pairs], shapes, [p])
    with pytest.raises(Diverged) as caught, replay(learned, shapes, [p]) as run:
        for name in shapes:
            p.copy_(run.stand_in(name))
            p.add_(1)
    assert caught.value.names == {"w": "its region, already filled, is written by the loader"}
    with pytest.raises(Diverged, match="'w': t applied to it"), replay(learned, shapes, [p]) as run:
        p.copy_(run.stand_in("w").reshape(2, 2).t().reshape(4))
    with pytest.raises(Diverged, match=r"'w': tolist\(\) asked of it"), replay(learned, shapes, [p]) as run:
        run.stand_in("w").tolist()


def test_a_replay_using_a_stand_in_where_meta_tensors_fail_is_a_divergence_not_a_crash() -> None:
    """The real call moves a tensor its dry run left alone to the CPU (no data on meta): `Diverged`,
    so the caller loads whole tensors, not the meta tensor's own error."""
    p = torch.zeros(4)
    shapes = {"w": ((4,), torch.float32), "extra": ((2,), torch.float32)}
    learned, _ = dry_run(lambda pairs: [p.copy_(t) for n, t in pairs if n == "w"], shapes, [p])
    assert learned.unused == {"extra"}
    with pytest.raises(Diverged, match="'extra': .* applied to it"), replay(learned, shapes, [p]) as run:
        p.copy_(run.stand_in("w"))
        run.stand_in("extra").to("cpu").sum()


def test_aten_overloads_count_as_writes() -> None:
    p = torch.zeros(4)
    shapes = {"w": ((4,), torch.float32)}

    def load(pairs: Pairs) -> None:
        for _, t in pairs:
            p.copy_(t)
            torch.ops.aten.fill_.Scalar(p, 9.0)  # an overload's name is "fill_.Scalar"

    learned, _ = dry_run(load, shapes, [p])
    assert learned.whole == {"w": "its parameter is written again after the copy"}


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
def test_fp8_weights_and_their_block_scales_are_placed_as_they_are_stored() -> None:
    """DeepSeek-V3's FP8 checkpoints: each expert's `weight` (float8_e4m3fn, [N, K]) with its
    `weight_scale_inv` (float32, one per 128x128 block). A tensor-parallel loader narrows the weight's
    rows and the scale's block rows alike; both are placed, in their own dtypes, at the rank's part."""
    w_param = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)  # rank 1 of 2: rows 128..255 of 256
    s_param = torch.zeros(1, 2, dtype=torch.float32)  # its block rows: 1 of 2

    def load(pairs: Pairs) -> None:
        for name, t in pairs:
            if name.endswith("weight_scale_inv"):
                s_param.copy_(t.narrow(0, 1, 1))
            else:
                w_param.copy_(t.narrow(0, 128, 128))

    tensors = {"experts.0.down_proj.weight": ((256, 256), torch.float8_e4m3fn),
               "experts.0.down_proj.weight_scale_inv": ((2, 2), torch.float32)}  # fmt: skip
    learned, _ = dry_run(load, tensors, [w_param, s_param])
    assert not learned.whole and not learned.unused
    weight, scale = learned.copies["experts.0.down_proj.weight"], learned.copies["experts.0.down_proj.weight_scale_inv"]
    assert weight.part == Slice(0, 128, 128) and weight.dest.dtype == torch.float8_e4m3fn
    assert scale.part == Slice(0, 1, 1) and scale.dest.dtype == torch.float32
    with replay(learned, tensors, [w_param, s_param]) as run:
        load((n, run.stand_in(n)) for n in tensors)
