"""Issue 39: no module of the package imports itself back through others (function-level imports count too; that
layers go downward, errors <- kernels <- runtime <- plan <- ops <- nn, is tests/test_bootstrap_select.py's), no
Python file under flux_shmem/ is over ~600 lines and no header under csrc/ over ~500."""
from __future__ import annotations

from pathlib import Path

from test_bootstrap_select import imports_of

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "flux_shmem"
def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG).with_suffix("").parts
        out[".".join(("flux_shmem",) + parts).removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in it)."""
    return {name: imports_of(path, "flux_shmem") & set(mods) - {name} for name, path in mods.items()}


def test_no_import_cycle():
    mods = modules()
    edges = imports(mods)
    packages = {n for n, p in mods.items() if p.name == "__init__.py"}  # re-exporting package inits aside
    state: dict[str, int] = {}
    found = []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(edges[u] - packages):
            if state.get(v) == 1:
                found.append(path[path.index(v):] + [v] if v in path else [u, v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for m in sorted(set(mods) - packages):
        if m not in state:
            visit(m, [m])
    assert not found, [" -> ".join(c) for c in found]
    assert len(mods) > 40


def test_file_sizes():
    py = {p: len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    headers = {p: len(p.read_text().splitlines()) for p in (ROOT / "csrc" / "include").rglob("*.cuh")}
    assert max(py.values()) <= 620, sorted(((n, str(p)) for p, n in py.items()), reverse=True)[:3]
    assert max(headers.values()) <= 500, sorted(((n, str(p)) for p, n in headers.items()), reverse=True)[:3]
