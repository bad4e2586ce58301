"""The ``apps`` extra: the optional dependencies only the applications need.

``pip install -e .`` installs the table library and its tiers; the demo's plot needs
matplotlib and the node service's ``/metrics`` needs prometheus-client, which come with
``pip install -e ".[apps]"`` (README's main-job command installs them). A command that needs
one checks it with :func:`require` before it starts anything, so a missing one is a
one-line error that names the package and the command that installs it.
"""

from __future__ import annotations

import importlib

from nvecache.apps.errors import MissingExtraError

#: import name -> the distribution pip installs (both in pyproject.toml's ``apps`` extra)
APPS_EXTRA: dict[str, str] = {
    "matplotlib": "matplotlib",
    "prometheus_client": "prometheus-client",
}
#: installs the extra from a checkout of the project (as README's main-job command does)
INSTALL_COMMAND = 'pip install -e ".[apps]"'


def require(module: str, needed_for: str) -> None:
    """Check that ``module`` of the ``apps`` extra can be imported.

    Args:
        module: an import name of :data:`APPS_EXTRA`, e.g. ``"matplotlib"``.
        needed_for: what needs it, for the message (e.g. ``"the demo's plot"``).

    Raises:
        MissingExtraError: it is not installed (or fails to import); the message names the
            package and the pip command.
    """
    try:
        # NOTE: an optional heavy dependency, imported by name only to check it is there;
        # the module that uses it imports it where it is used
        importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{needed_for} needs {APPS_EXTRA[module]}, which is not installed: install the "
            f"apps extra with `{INSTALL_COMMAND}` in the nvecache checkout"
        ) from e
