"""Coverage of the ranks: they measure when the pytest process measures, and their data joins the
pytest process's.

Parent side, at each pool start: :func:`parent_settings` reads the running ``coverage.Coverage`` of
this process (pytest-cov's ``--cov``, or ``coverage run -m pytest``), if any, without importing
coverage when it is not loaded: the configuration file it read and every measurement option
(``run:source``, ``run:branch``, ``run:include``, ``run:omit``, ``run:plugins``, ...), which include
the ones given as arguments rather than in the file (``--cov=pkg``). None when nothing measures: the
ranks then never import coverage.

Rank side: :func:`start` makes a ``Coverage`` with those settings and no data file, and starts it
before the rank imports anything of the tests. When the pool stops, :func:`collect` stops it and
serializes its data (``CoverageData.dumps``), which the rank sends to the controller as its last
message.

Parent side again: :func:`merge` adds that data to the running ``Coverage``'s data
(``CoverageData.update``), which pytest-cov then saves, combines and reports, or which ``coverage
run`` saves at exit. No file is written for a rank. The controller stops every pool at the end of
the test loop when coverage is measured, before pytest-cov reports.
"""

from __future__ import annotations

import sys
from typing import Any

#: Options copied to the ranks as they are (``run:concurrency`` is copied without
#: ``multiprocessing``).
_COPIED = ("branch", "context", "core", "cover_pylib", "disable_warnings", "dynamic_context",
           "include", "omit",
           "plugins", "relative_files", "source", "source_dirs", "source_pkgs", "timid", "paths")
#: Warnings a rank does not give: it measures only what its tests run, and the pytest process
#: reports on the whole.
_QUIET = ("module-not-imported", "module-not-measured", "no-data-collected", "no-ctracer")


def measuring() -> Any:
    """The running ``coverage.Coverage`` of this process, or None (coverage not loaded, or not
    started)."""
    module = sys.modules.get("coverage")
    if module is None:
        return None
    current = getattr(getattr(module, "Coverage", None), "current", None)
    return current() if current is not None else None


def parent_settings() -> dict[str, Any] | None:
    """What a rank needs to measure as this process does (picklable), or None when this process does
    not measure."""
    cov = measuring()
    if cov is None:
        return None
    options: dict[str, Any] = {}
    for name in _COPIED:
        key = name if name == "paths" else f"run:{name}"
        try:
            options[key] = cov.get_option(key)
        except Exception:  # noqa: BLE001 - an option this coverage version does not have
            continue
    concurrency = cov.get_option("run:concurrency") or []
    options["run:concurrency"] = [c for c in concurrency if c != "multiprocessing"] or None
    for plugin in options.get("run:plugins") or ():
        try:
            options.update({f"{plugin}:{k}": v for k,
                            v in cov.config.get_plugin_options(plugin).items()})
        except Exception:  # noqa: BLE001
            continue
    return {"config_file": getattr(cov.config, "config_file", None) or False, "options": options}


def start(settings: dict[str, Any]) -> Any:
    """Rank side: start measuring with the parent's settings; no data file. Returns the
    ``Coverage``."""
    import coverage

    cov = coverage.Coverage(data_file=None, config_file=settings["config_file"])
    for key, value in settings["options"].items():
        if value is not None:
            cov.set_option(key, value)
    quiet = list(settings["options"].get("run:disable_warnings") or ())
    cov.set_option("run:disable_warnings", quiet + [w for w in _QUIET if w not in quiet])
    cov.start()
    return cov


def collect(cov: Any) -> bytes:
    """Rank side: stop measuring; the data, serialized for :func:`merge`."""
    cov.stop()
    return cov.get_data().dumps()


def merge(blob: bytes) -> bool:
    """Parent side: add a rank's data to this process's running ``Coverage``. False when nothing
    measures here."""
    cov = measuring()
    if cov is None:
        return False
    from coverage import CoverageData

    data = CoverageData(no_disk=True)
    data.loads(blob)
    cov.get_data().update(data)
    return True
