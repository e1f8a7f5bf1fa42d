"""The package's shape: which modules may load what, and that there is no import cycle.

The import graph is read from the source with ``ast``, so it sees every import statement wherever
it stands: inside functions (a cycle hidden in a function is still a cycle) and under
``if TYPE_CHECKING:`` too (stricter than needed, since those never run, but a type-only cycle is
still two modules that each need the other). The packages that resolve names on first use
(``meshserve``, ``meshserve.actors``) name the same modules under TYPE_CHECKING, so their lazy
imports are in the graph as well. An edge goes from a module to the module it names; a package's
``__init__`` that re-exports its own submodules is an edge like any other, so it makes a cycle only
when one of those submodules imports the package back.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "meshserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(name: str, tree: ast.AST) -> set[str]:
    """The meshserve modules that module ``name`` imports, wherever the import stands."""
    found: set[str] = set()
    is_package = MODULES[name].name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` names the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` names a.b.c; keep the longest prefix that is a meshserve module.
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: _imported(name, ast.parse(path.read_text(), str(path)))
            for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_graph_reader_sees_every_kind_of_import() -> None:
    def read(name: str, source: str) -> set[str]:
        return _imported(name, ast.parse(source))

    assert read("meshserve.cli", "def f():\n    from meshserve.config import EngineConfig\n") == {
        "meshserve.config"}
    assert read("meshserve.cli", "if TYPE_CHECKING:\n    import meshserve.text.sequence\n") == {
        "meshserve.text.sequence"}
    assert read("meshserve.cli", "from .config import EngineConfig\n") == {"meshserve.config"}
    assert read("meshserve.actors", "from . import messages\n") == {"meshserve.actors.messages"}
    assert read("meshserve.actors.host", "from ..contracts import step\n") == {
        "meshserve.contracts.step"}


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_runner_imports_nothing_from_the_scheduler_side() -> None:
    forbidden = {"meshserve.engine.scheduler", "meshserve.engine.block_manager",
                 "meshserve.engine.engine", "meshserve.engine.llm"}
    graph = import_graph()
    offenders = {name: sorted(graph[name] & forbidden) for name in graph
                 if name.startswith("meshserve.runner") and graph[name] & forbidden}
    assert offenders == {}


def loaded_after(statements: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded after running ``statements``."""
    code = (f"import sys\n{statements}\n"
            f"print(sorted(m for m in {modules!r} if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=PACKAGE.parent)
    return ast.literal_eval(result.stdout.strip())


def test_scheduler_and_block_manager_load_neither_torch_nor_ray() -> None:
    assert loaded_after("import meshserve.engine.scheduler, meshserve.engine.block_manager",
                        ("torch", "ray")) == []


def test_the_cli_parser_loads_no_heavy_module() -> None:
    """Each subcommand imports what it uses when it runs; building the parser loads none of it."""
    statements = "from meshserve.cli import build_parser\nbuild_parser().parse_args(['serve'])"
    assert loaded_after(statements, ("torch", "ray", "httpx", "yaml", "transformers")) == []


def test_docs_link_only_inside_the_repository() -> None:
    repo = PACKAGE.parent
    docs = [repo / "README.md", *sorted(repo.glob("*/*.md"))]
    outside = []
    for doc in docs:
        text = doc.read_text()
        # Markdown links, and paths quoted as code that climb out of their folder.
        targets = re.findall(r"\]\(([^)#\s]+)", text) + re.findall(r"`(\.\./[^`\s]*)`", text)
        for target in targets:
            if "://" in target:
                continue
            resolved = (doc.parent / target).resolve()
            if not resolved.is_relative_to(repo) or not resolved.exists():
                outside.append(f"{doc.relative_to(repo)}: {target}")
    assert outside == []


# --- One source for every engine default ----------------------------------------------------


def test_every_engine_flag_defaults_to_its_config_default() -> None:
    from meshserve.cli import build_parser
    from meshserve.config import EngineConfig

    args = build_parser().parse_args(["serve"])
    defaults = EngineConfig().to_flat()
    assert set(defaults) <= set(vars(args))
    assert {name: getattr(args, name) for name in defaults} == defaults
    assert defaults["max_num_batched_tokens"] is None  # the device's own: Backend


def test_old_flag_spellings_still_parse() -> None:
    from meshserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--no-prefix-caching", "--num-kv-blocks", "40",
                                      "--data-parallel-size", "2", "--bucket-gap", "64"])
    assert (args.enable_prefix_caching, args.num_kv_blocks) == (False, 40)
    assert (args.data_parallel_size, args.bucket_gap) == (2, 64)


def test_serve_args_reach_every_engine_field() -> None:
    from meshserve.config import EngineConfig
    from meshserve.deploy.settings import ServeSettings

    flat = EngineConfig().to_flat()
    changed = {"model": "/models/m", "generation_config": "vllm", "dtype": "bfloat16",
               "device": "xla", "seed": 3,
               "compile_cache_dir": "/tmp/cache", "block_size": 32, "num_kv_blocks": 99,
               "enable_prefix_caching": False, "memory_fraction": 0.5,
               "device_memory_fraction": 0.5, "max_num_seqs": 7,
               "max_num_batched_tokens": 300, "max_model_len": 640, "bucket_gap": 64,
               "tensor_parallel_size": 2, "data_parallel_size": 2, "step_deadline_s": 5.0,
               "enforce_eager": True}
    assert set(changed) == set(flat), "a new engine field: add a changed value for it here"
    assert all(changed[name] != flat[name] for name in flat)
    settings = ServeSettings.from_args({**changed, "num_replicas": 2})
    assert settings.engine.to_flat() == changed
    assert settings.placement.num_replicas == 2


def test_unknown_args_are_named() -> None:
    from meshserve.config import EngineConfig
    from meshserve.deploy.settings import ServeSettings

    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig.from_flat({"num_blocks": 4})
    with pytest.raises(ValueError, match="bucket_gapp"):
        ServeSettings.from_args({"bucket_gapp": 4})


def test_every_config_field_has_help() -> None:
    from meshserve import config
    from meshserve.deploy.settings import ServeSettings

    classes = [config.ModelConfig, config.CacheConfig, config.SchedulerConfig,
               config.ParallelConfig, config.EngineConfig, config.PlacementConfig, ServeSettings]
    missing = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
               if not f.metadata.get("help")]
    assert missing == []


def test_every_flag_help_renders_as_its_setting_says() -> None:
    # argparse formats help text with %: a setting's "17% slower" must not swallow the argument's
    # attributes into the text.
    import argparse

    from meshserve.cli import add_setting_flags
    from meshserve.config import flat_settings
    from meshserve.deploy.settings import ServeSettings

    parser = argparse.ArgumentParser(formatter_class=lambda prog: argparse.HelpFormatter(
        prog, width=10_000))
    add_setting_flags(parser, ServeSettings)
    rendered = parser.format_help()
    assert "option_strings" not in rendered
    for s in flat_settings(ServeSettings):
        assert s.help in rendered, s.name
