"""Which processes of a real run imported a module: a ``sitecustomize`` put first on ``PYTHONPATH`` (the job's
processes inherit the launcher's environment) records, per process, its command line as it starts and the stack
where the watched module was first imported. The "started" files prove the hook ran in the processes looked at,
so an absent import is seen, not assumed."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

_HOOK = textwrap.dedent('''
    import json, os, sys, traceback
    _DIR, _WATCH = {dir!r}, {watch!r}
    with open("/proc/self/cmdline", "rb") as _f:  # sys.argv is not set yet for ``python -m``
        _ARGV = [a.decode(errors="replace") for a in _f.read().split(b"\\0") if a]
    with open(os.path.join(_DIR, f"started.{{os.getpid()}}.json"), "w") as _f:
        json.dump(_ARGV, _f)

    def _importing():  # an import statement, not importlib.util.find_spec's look-up that imports nothing
        f = sys._getframe(1)
        while f is not None and f.f_code.co_name != "_find_and_load":
            f = f.f_back
        return f is not None

    class _Watch:
        def find_spec(self, name, path=None, target=None):
            if name == _WATCH and _importing():
                with open(os.path.join(_DIR, f"imported.{{os.getpid()}}.txt"), "w") as f:
                    f.write(" ".join(_ARGV) + "\\n")
                    traceback.print_stack(file=f)
            return None

    sys.meta_path.insert(0, _Watch())
''')


class ImportAudit:
    def __init__(self, folder: Path, watch: str) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(_HOOK.format(dir=str(folder), watch=watch))

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": str(self.folder) + (os.pathsep + path if path else "")}

    def started(self, argv_has: str) -> list[int]:
        """The pids of the processes whose command line holds ``argv_has``."""
        out = []
        for p in self.folder.glob("started.*.json"):
            if any(argv_has in a for a in json.loads(p.read_text())):
                out.append(int(p.name.split(".")[1]))
        return sorted(out)

    def imported(self, pid: int) -> str | None:
        """Where process ``pid`` first imported the watched module (a stack), or None."""
        p = self.folder / f"imported.{pid}.txt"
        if not p.exists():
            return None
        text = p.read_text()
        started = json.loads((self.folder / f"started.{pid}.json").read_text())
        return text if text.split("\n", 1)[0] == " ".join(started) else None  # not a reused pid's
