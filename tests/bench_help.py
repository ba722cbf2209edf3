"""Run every ``bench/*.py --help`` in one process, each as ``python bench/<script>.py`` would.

tests/test_bench_smoke.py runs this as a subprocess. One process pays torch's import once, where
a process per script paid it 43 times (64 s of two cores on CI). Before each script, the project's
packages and the bench folder's own modules leave ``sys.modules`` and the script's folder is put
first on ``sys.path``, as the interpreter does for a script: a script that does not put the
repository root ahead of it imports ``bench/averaging.py`` as ``averaging``, and is reported.
Prints one JSON line: the scripts that failed, with their exit code or error and the packages
that came from the wrong place.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2p", "nat", "averaging", "training")


def main() -> None:
    bench = ROOT / "bench"
    scripts = sorted(bench.glob("*.py"))
    local = {p.stem for p in scripts}
    base = [p for p in sys.path if p not in ("", str(ROOT), str(bench))]
    failed = []
    for script in scripts:
        for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES or m.split(".")[0] in local]:
            del sys.modules[name]
        sys.path[:] = [str(bench), *base]
        sys.argv = [str(script), "--help"]
        code: object = 0
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code or 0
        except BaseException as error:  # noqa: BLE001 - reported, the next script runs
            code = f"{type(error).__name__}: {error}"
        wrong = [p for p in PACKAGES
                 if p in sys.modules and not str(getattr(sys.modules[p], "__file__", "")).startswith(str(ROOT / p))]
        if code != 0 or wrong:
            failed.append({"script": script.name, "exit": code, "wrong_packages": wrong})
    sys.stdout.flush()
    print("\n" + json.dumps({"scripts": len(scripts), "failed": failed}))


if __name__ == "__main__":
    main()
