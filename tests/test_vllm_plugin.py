"""The vLLM plugin never breaks vLLM: vLLM calls it in every process of an environment where streamload
is installed, without a guard (`integrations/vllm/__init__.py`: `register`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .vllm_engines import SUITE_ENVIRONMENT, Timed, recording, scenario

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parent.parent
VLLM_IN_ONE_PROCESS = {
    "PYTHONPATH": str(ROOT),
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
}

# Each in a fresh vLLM process of its own: run by `plugin_scripts`, beside the suite.
SCRIPTS = {
    # As under a vLLM release that renamed a name the integration registers through.
    "plugin/name-gone": """
        import json, sys
        import torch, transformers
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        del WeightTransferEngineFactory.register_engine  # renamed, say, by a later vLLM
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
        transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1] + "/m")
        from vllm import LLM, SamplingParams
        from vllm.model_executor.model_loader import get_model_loader, DefaultModelLoader
        from vllm.config.load import LoadConfig

        llm = LLM(model=sys.argv[1] + "/m", load_format="safetensors", skip_tokenizer_init=True,
                  enforce_eager=True, max_model_len=64, dtype="float32")
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, temperature=0),
                           use_tqdm=False)
        print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids)}))
        """,
    "plugin/untested-vllm": """
        import json, sys
        import vllm
        from vllm.config.load import LoadConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model_loader

        from streamload.integrations import vllm as vllm_plugin

        before = EngineArgs.create_load_config
        vllm.__version__ = "0.99.0"
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM may call it more than once
        try:
            get_model_loader(LoadConfig(load_format="streamload"))
            said = ""
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
        patched = EngineArgs.create_load_config is not before
        vllm.__version__ = "0.32.0"
        vllm_plugin.register()  # where it is tested: the integration and its hook
        tested = get_model_loader(LoadConfig(load_format="streamload"))
        print("RESULT " + json.dumps({"said": said, "patched": patched, "hooked": EngineArgs.create_load_config
              is not before, "loader": type(tested).__name__}))
        """,
}


def run_script(script: str, folder: Path, environment: dict[str, str], timeout: float = 300) -> dict[str, Any]:
    """`script` in a fresh Python, `folder` its argument: its exit status and what it printed."""
    folder.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(folder)], capture_output=True,
                         text=True, env={**environment, **VLLM_IN_ONE_PROCESS}, timeout=timeout)  # fmt: skip
    return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


@scenario("fresh")
def plugin_scripts(root: Path, out: Timed) -> None:
    for name, script in SCRIPTS.items():
        with recording(out, name):
            out[name] = run_script(script, root / name, SUITE_ENVIRONMENT)


def _result(run: dict[str, Any]) -> tuple[dict, str]:
    lines = [line for line in run["stdout"].splitlines() if line.startswith("RESULT ")]
    assert run["returncode"] == 0 and lines, run["stdout"][-3000:] + run["stderr"][-5000:]
    return json.loads(lines[-1][len("RESULT ") :]), run["stderr"]


def test_plain_vllm_starts_when_a_name_the_plugin_uses_is_gone(engines: dict[str, Any]) -> None:
    """As under a vLLM release that renamed a name the integration registers through: the plugin
    logs one line and plain vLLM starts and generates as without streamload."""
    result, stderr = _result(engines["plugin/name-gone"])
    assert len(result["tokens"]) == 3
    assert "the 'streamload' load format is not available (AttributeError:" in stderr
    assert "Traceback" not in stderr


def test_on_an_untested_vllm_nothing_is_patched_and_the_format_refuses_in_one_line(engines: dict[str, Any]) -> None:
    result, _ = _result(engines["plugin/untested-vllm"])
    assert not result["patched"]
    assert result["said"] == (
        "UnsupportedError: streamload's vLLM load format is tested with vLLM 0.32.0 only, and this is vLLM "
        "0.99.0: install one of those, or load with vLLM's own load formats"
    )
    assert result["hooked"] and result["loader"] == "StreamloadModelLoader"


def test_overlap_refuses_speculative_decoding() -> None:
    """A drafter is built beside the model and may share or compare its tensors before the weights are
    in: overlap is refused, naming it (the worker's config as vLLM's Worker carries it)."""
    import torch

    from streamload.integrations.vllm.startup import overlap

    model_config = SimpleNamespace(quantization=None, enable_sleep_mode=False)
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=model_config, speculative_config=SimpleNamespace(method="ngram")),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    assert "speculative decoding" in overlap.refusal(torch.nn.Linear(2, 2), model_config, worker)
    worker.vllm_config.speculative_config = None
    assert overlap.refusal(torch.nn.Linear(2, 2), model_config, worker) == ""


def test_overlap_refuses_a_quantized_model() -> None:
    """Its in-place reload into quantized parameters (packed weights, scales a kernel has repacked) is not
    proven exact: overlap keeps refusing quantized models, naming the method."""
    import torch

    from streamload.integrations.vllm.startup import overlap

    model_config = SimpleNamespace(quantization="compressed-tensors", enable_sleep_mode=False)
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=model_config, speculative_config=None),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    said = overlap.refusal(torch.nn.Linear(2, 2), model_config, worker)
    assert said == "the model is quantized (compressed-tensors): only unquantized models are checked"
