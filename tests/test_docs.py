"""The documentation cannot rot: the site builds with `mkdocs build --strict` (a broken link, anchor or API
reference fails it), and every Python example of the README and of docs/ runs, as written, against small
checkpoints made here.

The examples' placeholders are real here: `path/to/model`, `model/` and `path/to/llama` are a small
llama saved by transformers (with the digest file `streamload digest` writes), `path/to/pipeline` a small
diffusers pipeline, `s3://bucket/...` moto's S3 server on 127.0.0.1 (the standard AWS variables point
at it, as a user's environment would), `https://host/` a loopback HTTP server with Range and ETags
(the one substitution made in an example's text), `openai-community/gpt2` a Hugging Face cache entry
(`HF_HUB_OFFLINE=1`), and `~` the working folder. The blocks of one page run in order in one namespace,
as a reader runs them in one session. A block that needs what this machine lacks (a GPU, a vLLM engine,
other ranks) has `<!-- not run: why -->` on the line before it; it is still compiled, and counted."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN_AT_MOST = 10  # each mark is a place where a reader's example goes untested: keep them few
HUB_ID = "openai-community/gpt2"
HUB_COMMIT = "0" * 40


@dataclass
class Example:
    page: Path
    line: int  # of the block's first code line in the page
    code: str
    not_run: str | None  # why, where the page marks it

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(page: Path) -> list[Example]:
    """The page's fenced ```python blocks, in order, each with the `<!-- not run: why -->` mark before it."""
    text = page.read_text()
    found = []
    for block in re.finditer(r"^```python\n(.*?)^```[ \t]*$", text, re.S | re.M):
        before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = re.fullmatch(r"<!--\s*not run:\s*(.*?)\s*-->", before)
        line = text.count("\n", 0, block.start()) + 2
        found.append(Example(page, line, block.group(1), mark.group(1) if mark else None))
    return found


def compiled(example: Example, code: str | None = None) -> types.CodeType:
    """The block as code whose line numbers are the page's (top-level `await` allowed, as in a notebook)."""
    source = "\n" * (example.line - 1) + (example.code if code is None else code)
    return compile(source, str(example.page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


ALL = [e for page in PAGES for e in examples(page)]
RUN_PAGES = sorted({e.page for e in ALL if e.not_run is None}, key=PAGES.index)


# -- the site ---------------------------------------------------------------------------------------------


def test_the_site_builds_strictly_with_no_warning(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "WARNING" not in log, log
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    for page in (ROOT / "docs").glob("*.md"):  # every page is in the nav and built (strict fails on a stray one)
        assert (page.stem + "/index.html" if page.stem != "index" else "index.html") in built, page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Stream the tensors of a safetensors checkpoint" in api  # the reference is made from the docstrings


def test_the_readmes_links_reach_existing_pages() -> None:
    """mkdocs checks the links between the pages; the README lives outside them, so it is checked here."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local and [link for link in local if not (ROOT / link).exists()] == []
    assert len(readme.splitlines()) <= 250  # a newcomer reads it in five minutes: the rest is in docs/


# -- the README's test command ----------------------------------------------------------------------------


def readme_test_command() -> str:
    """The README's shell block that runs the tests."""
    blocks = [b for b in re.findall(r"^```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S | re.M)
              if "python -m pytest" in b]  # fmt: skip
    assert len(blocks) == 1, blocks
    return blocks[0]


def test_ci_runs_the_readmes_test_command_itself() -> None:
    """The command a reader copies is the one CI runs (the last line of .ci/run), so it is kept working."""
    ci = ROOT / ".ci" / "run"
    assert ci.read_text().strip().splitlines()[-1] == readme_test_command()
    assert subprocess.run(["bash", "-n", str(ci)], timeout=60).returncode == 0


def test_the_test_commands_nginx_step_updates_apt_first_and_lets_the_rest_run_without_it(tmp_path: Path) -> None:
    """Its first step, run with an `apt-get` that records its calls: the package lists are updated before
    the install (a fresh image has none), and where apt fails or is absent (no root, not Debian) the step
    still succeeds, so the command goes on and the network tests skip."""
    step = re.match(r"\((.*?)\) && ", readme_test_command())
    assert step and "apt-get" in step[1], readme_test_command()
    calls = tmp_path / "calls"

    def run(apt_get_exit: int | None) -> subprocess.CompletedProcess[str]:
        bin_dir = tmp_path / f"bin-{apt_get_exit}"
        bin_dir.mkdir()
        if apt_get_exit is not None:
            (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit {apt_get_exit}\n')
            (bin_dir / "apt-get").chmod(0o755)
        calls.write_text("")
        return subprocess.run(["/bin/bash", "-c", step[1]], env={"PATH": str(bin_dir)}, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    done = run(0)
    assert done.returncode == 0, done.stderr
    said = calls.read_text().splitlines()
    assert said[0] == "update -q" and said[1].startswith("install ") and "nginx-light" in said[1].split(), said
    for failing in (100, None):  # apt refuses (no root, no network), or there is no apt at all
        failed = run(failing)
        assert failed.returncode == 0 and "no nginx" in failed.stdout, (failed.stdout, failed.stderr)
        assert calls.read_text().splitlines() == (["update -q"] if failing else [])


# -- the examples -----------------------------------------------------------------------------------------


def test_every_example_not_run_says_why_compiles_and_they_are_few(capsys: pytest.CaptureFixture[str]) -> None:
    skipped = [e for e in ALL if e.not_run is not None]
    for example in skipped:
        assert example.not_run, f"{example}: a `not run` mark says why"
        compiled(example)  # a syntax error is caught even where the block cannot run here
    for example in ALL:
        assert "<!--" not in example.code, f"{example}: a mark inside a block does nothing"
    assert len(skipped) <= NOT_RUN_AT_MOST, [str(e) for e in skipped]
    with capsys.disabled():
        print(f"\ndocs examples: {len(ALL) - len(skipped)} run, {len(skipped)} not run here:")
        for example in skipped:
            print(f"  {example}: {example.not_run}")


def test_every_example_that_builds_a_vllm_engine_builds_it_under_a_main_guard() -> None:
    """vLLM starts its workers by spawning, which imports the script again: an `LLM(...)` at a script's
    top level starts engines without end (or fails), so an example builds one under
    `if __name__ == "__main__":` or in a function, never on import (these examples need an engine to run)."""

    def is_guard(node: ast.AST) -> bool:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True  # its body runs when called, not when the script is imported
        return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'

    def engines(tree: ast.AST) -> list[ast.Call]:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) in ("LLM", "vllm.LLM")]

    built = 0
    for example in ALL:
        tree = ast.parse(example.code)
        guarded = {id(call) for guard in ast.walk(tree) if is_guard(guard) for call in engines(guard)}
        for call in engines(tree):
            built += 1
            assert id(call) in guarded, f"{example}: line {example.line + call.lineno - 1} builds an engine unguarded"
    assert built, "no example builds a vLLM engine: this test checks nothing"


def llama(folder: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def hub_cache(root: Path, model: Path) -> Path:
    """`HUB_ID` at `HUB_COMMIT` in huggingface_hub's cache layout, its files linked from the blobs."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / HUB_COMMIT
    snapshot.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file():
            blob = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, repo / "blobs" / blob)
            (snapshot / f.name).symlink_to(Path("../../blobs") / blob)
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A working folder where the pages' paths exist, its servers running; yields the substitutions."""
    from safetensors import safe_open

    from streamload.commands.cli import main
    from testbed.diffusers_pipelines import stable_diffusion

    from .servers import RangeServer, s3_server, upload

    ws = tmp_path_factory.mktemp("docs")
    model = llama(ws / "path" / "to" / "model")
    assert main(["digest", str(model)]) == 0  # what `streamload digest model/` writes, for verify=True
    for name in ("model", "path/to/llama"):
        shutil.copytree(model, ws / name)
    stable_diffusion(ws / "path" / "to" / "pipeline")
    shutil.copytree(model, ws / "http" / "llama")
    with safe_open(str(model / "model.safetensors"), "pt") as f:  # the index the https example names
        index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    (ws / "http" / "llama" / "model.safetensors.index.json").write_text(json.dumps(index))
    http = RangeServer(ws / "http")
    with pytest.MonkeyPatch.context() as patch, s3_server(patch) as s3:
        upload(s3, "bucket", "models/llama/", model)
        upload(s3, "bucket", "model/", model)
        for key, value in {"HOME": str(ws), "HF_HUB_CACHE": str(hub_cache(ws / "hub", model)),
                           "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
            patch.setenv(key, value)
        patch.chdir(ws)
        try:
            yield {"https://host/": http.url + "/"}
        finally:
            http.close()


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_pages_examples_run(page: Path, workspace: dict[str, str]) -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}
    for example in examples(page):
        if example.not_run is not None:
            continue
        code = example.code
        for placeholder, real in workspace.items():
            code = code.replace(placeholder, real)
        began = time.monotonic()
        try:
            result = eval(compiled(example, code), namespace)  # the project's own pages
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        except Exception as e:
            raise AssertionError(f"{example}: the example fails: {type(e).__name__}: {e}") from e
        assert time.monotonic() - began < 20, f"{example}: an example runs in seconds, or is marked"


@pytest.mark.parametrize("example", ["load_sync.py", "stream_async.py"])
def test_an_example_given_no_path_prints_its_usage_and_exits_2(example: str) -> None:
    script = ROOT / "examples" / example
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "usage:" in done.stderr and example in done.stderr, done.stderr
