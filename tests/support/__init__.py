"""Helpers shared by the test modules (no tests here).

Importing this package under Triton's CPU interpreter (``TRITON_INTERPRET=1``) installs
:mod:`tests.support.interpreter_patching`, in pytest's processes (through the project's conftest) and in the plugin's
ranks (through the test modules that import a helper), so both run the interpreter tests at the same speed.
"""

import os

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    from .interpreter_patching import install

    install()
