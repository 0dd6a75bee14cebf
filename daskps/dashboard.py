"""``dask scheduler --preload daskps.dashboard``: the parameter-server page for a scheduler you start.

Importing this module adds the ``/individual-daskps`` page to the dashboard
of schedulers started afterwards; Dask then calls :func:`dask_setup`, which
adds the scheduler plugin behind it. See :mod:`daskps.ui.dashboard`.
"""

from __future__ import annotations

from daskps.scheduler.plugin import DaskPSSchedulerPlugin, install_plugin
from daskps.ui.dashboard import dask_setup, register_page

__all__ = ["DaskPSSchedulerPlugin", "dask_setup", "install_plugin", "register_page"]

register_page()
