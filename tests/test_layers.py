"""The layering of README's layout section, checked over every import in the product's packages, including
imports inside functions and `importlib.import_module("...")` with a literal name:

    duet (the command line: cli*.py, client, demo)         imported by nothing
    benchmarks.sim (simulators over the real policies)     below the command line only
    router | deploy | prefill_worker, decode_worker        router and deploy never import a worker; workers never
                                                           the router; the two worker kinds not each other
    worker (what both worker kinds share)
    cluster (registry, prefix index, KV events, protobuf conversions, gRPC plumbing)
    kvtransfer                                             engine only
    engine                                                 nothing outside engine
    duet.v1, duet.internal (generated gRPC stubs)          nothing of ours; usable by every layer
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kvtransfer", "cluster", "worker", "prefill_worker", "decode_worker", "router", "deploy", "duet",
            "benchmarks/sim")

# layer -> the other layers it may import
ALLOWED: dict[str, set[str]] = {
    "engine": set(),
    "api": set(),
    "kvtransfer": {"engine"},
    "cluster": {"engine", "kvtransfer", "api"},
    "worker": {"engine", "kvtransfer", "api", "cluster"},
    "prefill_worker": {"engine", "kvtransfer", "api", "cluster", "worker"},
    "decode_worker": {"engine", "kvtransfer", "api", "cluster", "worker"},
    "router": {"engine", "api", "cluster"},
    "deploy": {"engine", "api", "cluster"},
    "benchmarks": {"engine", "api", "cluster", "router", "deploy"},
    "cli": {"engine", "kvtransfer", "api", "cluster", "worker", "prefill_worker", "decode_worker", "router", "deploy",
            "benchmarks"},
}
OURS = {"engine", "kvtransfer", "cluster", "worker", "prefill_worker", "decode_worker", "router", "deploy", "duet",
        "benchmarks"}


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to; None for a module that is not ours."""
    top = module.split(".")[0]
    if top not in OURS:
        return None
    if top == "duet":
        return "api" if module.startswith(("duet.v1", "duet.internal")) else "cli"
    return top


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `source` imports, wherever the import statement is; relative imports
    resolved against `module` (the importing module's dotted name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]  # `from duet import cli`
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, module: str) -> list[str]:
    own = layer_of(module)
    out = []
    for line, name in imported_modules(source, module):
        target = layer_of(name)
        if target is None or target == own:
            continue
        if target not in ALLOWED[own]:
            out.append(f"{module}:{line} ({own}) imports {name} ({target})")
    return out


def product_modules() -> list[tuple[Path, str]]:
    files = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            files.append((path, ".".join(rel.parts).removesuffix(".__init__")))
    files.append((REPO / "benchmarks" / "__init__.py", "benchmarks"))
    return files


def test_every_import_respects_the_layers():
    found = []
    for path, module in product_modules():
        found += violations(path.read_text(), module)
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_checker_sees_every_kind_of_import():
    assert product_modules(), "no modules found: the checker would pass vacuously"
    source = '''
import engine.model
from router import server as s
def later():
    from prefill_worker.server import PrefillWorker
    import deploy.local_cluster
    importlib.import_module("duet.cli")
from . import registry
from ..router import prefix_policy
'''
    found = violations(source, "cluster.sub.module")
    assert sorted(f.split(" imports ")[1] for f in found) == [
        "deploy.local_cluster (deploy)", "duet.cli (cli)", "prefill_worker.server (prefill_worker)",
        "prefill_worker.server.PrefillWorker (prefill_worker)", "router (router)", "router.server (router)",
    ]


@pytest.mark.parametrize(("module", "name", "ok"), [
    ("engine.model", "kvtransfer.layout", False),
    ("engine.model", "engine.attention", True),
    ("kvtransfer.sender", "engine.config", True),
    ("kvtransfer.sender", "cluster.registry", False),
    ("router.server", "prefill_worker.server", False),
    ("router.server", "deploy.redis_server", False),
    ("router.server", "duet.v1.generation_pb2", True),
    ("prefill_worker.server", "router.server", False),
    ("prefill_worker.server", "decode_worker.server", False),
    ("deploy.local_cluster", "duet.cli", False),
    ("duet.cli", "router.server", True),
    ("cluster.registry", "worker.process", False),
])
def test_layer_rules(module, name, ok):
    assert (violations(f"import {name}\n", module) == []) is ok
