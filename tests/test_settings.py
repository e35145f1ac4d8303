"""streamload's environment variables: one table (streamload/base/settings.py), each read when it is used, one
reading of true/false, a value that cannot be read refused in one line naming the variable and the value; and no
module but settings.py reads a STREAMLOAD_ variable itself."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamload.base import progress, settings
from streamload.base.settings import ALL, FALSE, TRUE, SettingError, switched_on, truth
from streamload.storage import hub, peer_proof, peers, remote

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamload"
HOME = PACKAGE / "base" / "settings.py"

# a value each setting reads, and what it reads it as (every setting has one: a new one must add its own)
GOOD: dict[str, tuple[str, object]] = {
    "STREAMLOAD_TIMEOUT": (" 2.5 ", 2.5),
    "STREAMLOAD_RETRIES": ("0", 0),
    "STREAMLOAD_ALLOW_UNVALIDATED": ("On", True),
    "STREAMLOAD_PEER_TIMEOUT": ("1", 1.0),
    "STREAMLOAD_PEERS_UNVERIFIED": ("no", False),
    "STREAMLOAD_PEER_CA": (" /etc/ca.pem ", "/etc/ca.pem"),
    "STREAMLOAD_PEER_TOKEN": ("s3cret\n", "s3cret"),
    "STREAMLOAD_PEER_TOKEN_FILE": ("/run/token", "/run/token"),
    "STREAMLOAD_PROGRESS_AFTER": ("0", 0.0),
    "STREAMLOAD_FETCH": ('{"pid": 1}', '{"pid": 1}'),
    "STREAMLOAD_VLLM_CHECK": ("/srv/digests", "/srv/digests"),
}
# values each setting refuses (text and paths take anything)
BAD: list[tuple[str, str]] = [
    *(("STREAMLOAD_TIMEOUT", v) for v in ("0", "-1", "nan", "inf", "30s")),
    *(("STREAMLOAD_RETRIES", v) for v in ("-1", "2.5", "four")),
    *(("STREAMLOAD_ALLOW_UNVALIDATED", v) for v in ("2", "ture", "y")),
    *(("STREAMLOAD_PEER_TIMEOUT", v) for v in ("0", "5s", "-inf")),
    *(("STREAMLOAD_PEERS_UNVERIFIED", v) for v in ("enabled", "-1")),
    *(("STREAMLOAD_PROGRESS_AFTER", v) for v in ("-1", "nan", "soon")),
]
BY_NAME = {s.name: s for s in ALL}


def one_line_naming(exc: pytest.ExceptionInfo[BaseException], name: str, raw: str) -> None:
    said = str(exc.value)
    assert "\n" not in said and name in said and repr(raw) in said, said


# -- the one reading of true/false ---------------------------------------------------------------------
@pytest.mark.parametrize("word", TRUE + FALSE)
def test_truth_reads_each_spelling_in_any_case(word: str) -> None:
    for said in (word, word.upper(), word.title(), f"  {word}\n"):
        assert truth("STREAMLOAD_X", said) is (word in TRUE)


@pytest.mark.parametrize("raw", ["2", "y", "n", "enable", "ture", "", "1 0", "none"])
def test_truth_refuses_anything_else_in_one_line(raw: str) -> None:
    with pytest.raises(SettingError) as exc:
        truth("STREAMLOAD_X", raw)
    one_line_naming(exc, "STREAMLOAD_X", raw)
    assert isinstance(exc.value, ValueError)  # callers that caught the ValueError of a bad value still do


def test_other_libraries_switches_are_read_as_theirs_never_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(switched_on(w) for w in ("1", "ON", "yes", " True "))
    assert not any(switched_on(w) for w in (None, "", "0", "off", "maybe"))
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    unset = progress.bars_enabled()
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "maybe")  # huggingface_hub: not on; so not refused here
    assert progress.bars_enabled() == unset
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "Yes")
    assert not progress.bars_enabled()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "on")
    assert hub.offline()


# -- each setting ----------------------------------------------------------------------------------------
def test_the_table_names_each_variable_once() -> None:
    names = [s.name for s in ALL]
    assert len(names) == len(set(names)) and all(re.fullmatch(r"STREAMLOAD_[A-Z0-9_]+", n) for n in names)
    assert set(names) == set(GOOD), "each setting has a value it reads in GOOD"
    assert all(s.meaning and s.kind for s in ALL)


@pytest.mark.parametrize("setting", ALL, ids=lambda s: s.name)
def test_unset_or_empty_is_the_default(setting: settings.Setting[object], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(setting.name, raising=False)
    assert setting.get() == setting.default
    for empty in ("", "  "):
        monkeypatch.setenv(setting.name, empty)
        assert setting.get() == setting.default


@pytest.mark.parametrize("setting", ALL, ids=lambda s: s.name)
def test_each_is_read_when_used(setting: settings.Setting[object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Set after streamload is imported (as a test or a launcher does), the value counts at once."""
    raw, read = GOOD[setting.name]
    monkeypatch.setenv(setting.name, raw)
    assert setting.get() == read
    setting.clear()
    assert setting.name not in os.environ and setting.get() == setting.default
    setting.put(raw)
    assert os.environ[setting.name] == raw


@pytest.mark.parametrize(("name", "raw"), BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_each_refuses_a_value_it_cannot_read_in_one_line(name: str, raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(SettingError) as exc:
        BY_NAME[name].get()
    one_line_naming(exc, name, raw)


def test_the_modules_read_their_settings_now(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each module's reading goes through the table: the values set now, refusals included."""
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "0.01")
    assert peers.timeout() == 0.05  # the floor a peer's timeout keeps
    monkeypatch.setenv("STREAMLOAD_PEER_TIMEOUT", "5s")  # was taken as 5, silently
    with pytest.raises(SettingError, match="STREAMLOAD_PEER_TIMEOUT='5s'"):
        peers.timeout()
    monkeypatch.setenv("STREAMLOAD_PEERS_UNVERIFIED", "on")  # was "no": only 1, true and yes were read as yes
    assert peers.unverified_allowed()
    monkeypatch.setenv("STREAMLOAD_PEERS_UNVERIFIED", "ture")  # was "no", silently
    with pytest.raises(SettingError, match="STREAMLOAD_PEERS_UNVERIFIED='ture'"):
        peers.unverified_allowed()
    monkeypatch.setenv("STREAMLOAD_ALLOW_UNVALIDATED", "2")
    with pytest.raises(SettingError, match="STREAMLOAD_ALLOW_UNVALIDATED='2'"):
        remote._refuse_or_warn([Path("model.safetensors")])
    monkeypatch.setenv("STREAMLOAD_PROGRESS_AFTER", "inf")  # never drawn
    assert progress._after() == math.inf
    token = tmp_path / "token"
    token.write_text("from-the-file\n")
    monkeypatch.setenv("STREAMLOAD_PEER_TOKEN", "from-the-variable")
    assert peer_proof.token() == b"from-the-variable"
    monkeypatch.setenv("STREAMLOAD_PEER_TOKEN_FILE", str(token))
    assert peer_proof.token() == b"from-the-file"


def test_a_store_refuses_its_retries_and_timeout_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("obstore")
    monkeypatch.setenv("STREAMLOAD_RETRIES", "four")
    with pytest.raises(SettingError, match="STREAMLOAD_RETRIES='four'"):
        remote.ObjectStorage("http://127.0.0.1:9/model/")  # refused before any request
    monkeypatch.setenv("STREAMLOAD_RETRIES", "2")
    monkeypatch.setenv("STREAMLOAD_TIMEOUT", "0.5")
    store = remote.ObjectStorage("http://127.0.0.1:9/model/")
    assert store.retries == 2 and remote._timeout() == 0.5


def test_the_command_says_a_bad_setting_in_one_line() -> None:
    pytest.importorskip("obstore")
    env = {**os.environ, "STREAMLOAD_TIMEOUT": "30s"}
    done = subprocess.run(
        [sys.executable, "-m", "streamload", "inspect", "http://127.0.0.1:9/model/model.safetensors"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and done.stdout == ""
    said = "streamload: error: STREAMLOAD_TIMEOUT='30s': give seconds, more than 0"
    assert done.stderr.strip().splitlines() == [said]


# -- nothing but settings.py reads one ----------------------------------------------------------------
VARIABLE = re.compile(r"STREAMLOAD_[A-Z0-9_]*")
_ENV_CALLS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}


def environment_uses(source: str) -> list[str]:
    """Where `source` spells a STREAMLOAD_ variable's name itself, or reaches os.environ (os.getenv, putenv,
    unsetenv) with a key taken from settings.py: both mean a variable read or written outside settings.py."""
    tree = ast.parse(source)
    bound: set[str] = set()  # names standing for settings.py or something in it
    environ: set[str] = set()  # os.environ and os.getenv as `from os import ...` named them
    getters: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("streamload.base", "streamload.base.settings"):
            for alias in node.names:
                if node.module.endswith("settings") or alias.name == "settings":
                    bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            bound |= {a.asname for a in node.names if a.name == "streamload.base.settings" and a.asname}
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            environ |= {a.asname or a.name for a in node.names if a.name == "environ"}
            getters |= {a.asname or a.name for a in node.names if a.name in ("getenv", "putenv", "unsetenv")}

    def names(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    for node in ast.walk(tree):  # ENV = settings.FETCH.name: ENV stands for a setting too
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and names(node.value) & bound:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {t.id for t in targets if isinstance(t, ast.Name)}

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os") or (isinstance(node, ast.Name) and node.id in environ)  # fmt: skip

    def is_getter(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in ("getenv", "putenv", "unsetenv")
                and isinstance(node.value, ast.Name) and node.value.id == "os") or (
                isinstance(node, ast.Name) and node.id in getters)  # fmt: skip

    found = []
    for node in ast.walk(tree):
        key: ast.AST | None = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
            found.append(f"{node.lineno}: {node.value!r} spelt outside settings.py")
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and (
            is_getter(node.func) or (isinstance(node.func, ast.Attribute) and node.func.attr in _ENV_CALLS
                                     and is_environ(node.func.value))):  # fmt: skip
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and names(key) & bound:
            found.append(f"{node.lineno}: the environment reached with {ast.unparse(key)}, a setting's name")
    return found


@pytest.mark.parametrize(
    "source",
    [
        'import os\nos.environ.get("STREAMLOAD_TIMEOUT", "30")',
        'import os\nENV = "STREAMLOAD_FETCH"\nos.environ.pop(ENV, None)',
        'from os import getenv\ngetenv("STREAMLOAD_" + "RETRIES")',
        "import os\nfrom streamload.base import settings\nos.environ[settings.FETCH.name] = '{}'",
        "import os\nfrom streamload.base import settings\nENV = settings.VLLM_CHECK.name\nx = ENV in os.environ",
        "from os import environ as e\nfrom streamload.base.settings import FETCH\ndel e[FETCH.name]",
        "import os\nimport streamload.base.settings as s\nos.getenv(s.TIMEOUT.name)",
    ],
)
def test_the_scan_finds_each_way_of_reading_one(source: str) -> None:
    assert environment_uses(source), source


def test_the_scan_leaves_other_variables_and_messages() -> None:
    source = (
        "import os\nfrom streamload.base import settings\n"
        'os.environ.get("HF_HUB_OFFLINE")\nos.environ["VLLM_CACHE_ROOT"] = "x"\n'
        'msg = f"{settings.TIMEOUT.name}: see STREAMLOAD_TIMEOUT, STREAMLOAD_RETRIES"\nsettings.FETCH.get()\n'
    )
    assert environment_uses(source) == []


def test_only_settings_reads_a_streamload_variable() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME
        for where in environment_uses(path.read_text())
    ]
    assert found == [], "\n".join(found)


def test_every_variable_the_package_names_is_in_the_table() -> None:
    """A message or docstring naming a STREAMLOAD_ variable names one the table defines (and docs/defaults.md
    lists): none is read, or mentioned, without its entry."""
    named = {m for path in PACKAGE.rglob("*.py") for m in re.findall(r"STREAMLOAD_[A-Z0-9_]+", path.read_text())}
    assert named - set(BY_NAME) == set(), sorted(named - set(BY_NAME))
