"""Device work lives behind the device kinds (streamload/device/kinds.py): no module outside
streamload/device/ makes a CUDA decision, and the kinds behave as their callers rely on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from streamload import UnsupportedError
from streamload.base import tuning as defaults
from streamload.device import kinds
from streamload.pipeline import reader_choice as routes

PACKAGE = Path(__file__).resolve().parent.parent / "streamload"
DEVICE_PACKAGE = PACKAGE / "device"
# torch's device types (torch.device accepts these names): comparing one to a value is a device decision
DEVICE_TYPES = {"cpu", "cuda", "mps", "xpu", "hip", "meta", "xla", "hpu", "mtia", "ipu", "ve", "lazy", "privateuseone"}


def _device_literal(node: ast.AST) -> str | None:
    """The device type a literal names: "cuda", or one inside a literal tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(":")[0] in DEVICE_TYPES:
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return next((found for e in node.elts if (found := _device_literal(e)) is not None), None)
    return None


def device_decisions(source: str, filename: str = "<source>") -> list[str]:
    """The CUDA decisions in a module's source, each as "line: what": `torch.cuda` named in any way
    (an attribute, an import), `.is_cuda`, and a value compared with a device type's name (`==`, `!=`,
    `in`, `not in`, `is`, or `.startswith`). Device facts that say nothing of a type (`t.is_cpu`: host
    memory, `a.type != b.type`) are not decisions about CUDA and pass."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            if node.attr == "is_cuda":
                found.append(f"{line}: .is_cuda")
            elif node.attr == "cuda" and isinstance(node.value, ast.Name) and node.value.id == "torch":
                found.append(f"{line}: torch.cuda")
        elif isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.startswith("torch.cuda")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith("torch.cuda") or (module == "torch" and any(a.name == "cuda" for a in node.names)):
                found.append(f"{line}: from {module} import ...")
        elif isinstance(node, ast.Compare):
            named = [_device_literal(x) for x in (node.left, *node.comparators)]
            found += [f"{line}: compared with {n!r}" for n in named if n is not None]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(_device_literal(a) is not None for a in node.args)
        ):
            found.append(f"{line}: .{node.func.attr}({_device_literal(node.args[0])!r})")
    return found


def test_no_module_outside_the_device_package_makes_a_cuda_decision() -> None:
    leaks = [
        f"{path.relative_to(PACKAGE.parent)}:{where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if DEVICE_PACKAGE not in path.parents
        for where in device_decisions(path.read_text(), str(path))
    ]
    assert leaks == [], "ask the device kind (streamload/device/kinds.py) instead:\n" + "\n".join(leaks)


@pytest.mark.parametrize(
    "source",
    [
        "ok = t.is_cuda",
        "torch.cuda.synchronize()",
        "import torch.cuda",
        "from torch import cuda",
        "from torch.cuda import Stream",
        "if dev.type == 'cuda': pass",
        "gpu = device_type != 'cpu'",
        "x = 'cuda' if a else b\nif device == 'cuda:0': pass",
        "if dev.type in ('cpu', 'mps'): pass",
        "ok = name.startswith('cuda')",
    ],
)
def test_the_scan_finds_each_way_of_deciding_on_cuda(source: str) -> None:
    assert device_decisions(source)


@pytest.mark.parametrize(
    "source",
    ["ok = t.is_cpu", "same = a.type == b.type", "kind = kinds.kind_of(dev)", "name = 'cuda'", "x = mode == 'cold'"],
)
def test_the_scan_passes_device_neutral_code(source: str) -> None:
    assert device_decisions(source) == []


def test_every_registered_kind_is_its_torch_device_type() -> None:
    assert set(kinds.KINDS) >= {"cpu", "cuda"}
    for name, kind in kinds.KINDS.items():
        assert kind.type == name
        assert kind_of_type(name) is kind


def kind_of_type(name: str) -> kinds.DeviceKind:
    return kinds.kind_of(torch.device(name))


def test_the_cpu_kind_holds_host_memory_and_its_stream_work_is_a_no_op() -> None:
    cpu = kinds.kind_of("cpu")
    dev = torch.device("cpu")
    assert cpu.host_memory and cpu.available()
    t = torch.arange(4)
    cpu.hand_off(t)  # nothing to tie to a stream: the tensor is unchanged and usable
    assert t.tolist() == [0, 1, 2, 3]
    with cpu.copy_stream(dev):
        copied = t.to(dev, non_blocking=True)
    ready = cpu.mark_ready(dev)
    assert ready is None
    cpu.wait_ready(dev, ready)
    cpu.synchronize(dev)
    assert copied is t  # to() onto the same device is the tensor itself
    assert cpu.pin(t) is t  # host memory needs no pinning to be copied from
    assert cpu.pin_slot(torch.empty(4096, dtype=torch.uint8), 4096) is False
    assert cpu.compute_capability() is None
    assert cpu.staging == defaults.HOST_STAGING


def test_the_cuda_kind_says_what_it_is_without_a_gpu() -> None:
    cuda = kinds.kind_of("cuda:1")
    assert not cuda.host_memory
    assert cuda.staging == defaults.DEVICE_STAGING
    assert "device" in cuda.lands and "mapped" not in cuda.lands  # kvikio's device slots; no file mappings
    if not torch.cuda.is_available():
        assert not cuda.available()
        assert cuda.compute_capability() is None


def test_an_unknown_device_type_is_a_one_line_error_naming_it() -> None:
    with pytest.raises(UnsupportedError, match=r"^device meta is not supported \(use 'cpu', 'cuda' or 'cuda:N'\)$"):
        kinds.kind_of(torch.device("meta"))


def test_the_default_device_is_the_first_available_accelerator_else_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kinds.default_kind() is kinds.kind_of("cpu")
    assert kinds.resolve(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert kinds.default_kind() is kinds.kind_of("cuda")
    assert kinds.resolve(None) == torch.device("cuda", 2)
    assert kinds.same(torch.device("cuda"), torch.device("cuda", 2))  # "cuda" is the current one
    assert not kinds.same(torch.device("cuda"), torch.device("cuda", 0))


def test_a_cpu_tuning_and_a_device_tuning_differ_as_their_staging_says() -> None:
    host = defaults.tuning(kinds.kind_of("cpu").staging, 8 << 30)
    device = defaults.tuning(kinds.kind_of("cuda").staging, 8 << 30)
    assert (host.slots, host.chunk_bytes) == (4, 8 << 20)
    assert (device.slots, device.chunk_bytes) == (8, 32 << 20)


def test_each_kind_builds_the_device_for_every_landing_it_takes() -> None:
    cpu = kinds.kind_of("cpu")
    assert set(cpu.lands) == {"host", "mapped"}
    staged = cpu.staging_device(torch.device("cpu"), "host")
    mapped = cpu.staging_device(torch.device("cpu"), "mapped")
    assert (staged.staged, mapped.staged) == (True, False)
    staged.close()
    mapped.close()


def test_every_tensor_a_stream_hands_out_is_handed_off_by_its_kind_in_the_receiving_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What CUDA needs (`record_stream` on the receiver's current stream) is asked of every kind, so
    a new accelerator's tensors are never handed out without it."""
    import threading

    from safetensors.torch import save_file

    import streamload
    from streamload.device.cpu import CPUKind

    handed: list[tuple[int, bool]] = []

    class Recording(CPUKind):
        def hand_off(self, t: torch.Tensor) -> None:
            handed.append((t.data_ptr(), threading.current_thread() is threading.main_thread()))

    save_file({f"t{i}": torch.full((64,), float(i)) for i in range(5)}, str(tmp_path / "m.safetensors"))
    monkeypatch.setitem(kinds.KINDS, "cpu", Recording())
    with streamload.iter(tmp_path / "m.safetensors", device="cpu", reader="posix") as stream:
        delivered = [t.data_ptr() for _, t in stream]
    assert handed == [(p, True) for p in delivered]


def test_a_reader_landing_where_the_device_cannot_take_bytes_is_refused_naming_both() -> None:
    tuning = defaults.tuning(defaults.HOST_STAGING, 1 << 20)
    with pytest.raises(UnsupportedError, match=r"the kvikio reader reads into device memory, which cpu does not take"):
        routes.route(torch.device("cpu"), "kvikio", True, tuning)  # a local storage's files


def test_the_cuda_kinds_stream_work_goes_to_the_streams_it_must(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, torch.cuda's stream calls stand in as recorders: a tensor handed out is tied to the receiving
    thread's current stream of its own device, a ready mark is recorded on the device's loader stream, and a wait
    is the current stream waiting on that mark. (On a GPU: not measured here.)"""
    import streamload.device.cuda as cuda_device
    from streamload.device import KINDS

    calls: list[tuple[str, object]] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, event: object) -> None:
            calls.append((f"{self.name}.wait_event", event))

    class Event:
        def record(self, stream: Stream) -> None:
            calls.append(("event.record", stream.name))

    class Handed:
        device = torch.device("cuda", 1)

        def record_stream(self, stream: Stream) -> None:
            calls.append(("record_stream", stream.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(f"current:{device}"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(cuda_device, "loader_stream", lambda dev: Stream(f"loader:{dev}"))
    kind, dev = KINDS["cuda"], torch.device("cuda", 1)
    kind.hand_off(Handed())  # type: ignore[arg-type]
    ready = kind.mark_ready(dev)
    kind.wait_ready(dev, ready)
    kind.wait_ready(dev, None)  # nothing marked: nothing to wait for
    assert calls == [("record_stream", "current:cuda:1"), ("event.record", "loader:cuda:1"),
                     ("current:cuda:1.wait_event", ready)]  # fmt: skip
