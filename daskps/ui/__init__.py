"""What people see, on top of every other layer: reprs for Jupyter, the dashboard page and plots,
progress bars, TensorBoard scalars and Prometheus' ``/metrics``.

Nothing below imports this package. The domain hands plain views of itself
(:mod:`daskps._core.views`) and these modules register, when imported, how
each view is drawn, the checkpoint's progress bar, the scheduler plugin's
``/metrics`` collector and a ``LocalPSCluster``'s dashboard page;
``import daskps`` imports them all, except the dashboard page's own module
(:mod:`daskps.ui.dashboard`, which needs Bokeh): a cluster imports it as its
scheduler starts, so processes that show no dashboard (workers, scripts on an
existing cluster) do not load Bokeh.
"""

from typing import Any

from daskps._core import views
from daskps.ui import display, progress, prometheus  # noqa: F401  (each registers its drawers)


class _DashboardOnLocalCluster(views.ClusterExtra):
    """Registered in :data:`daskps._core.views.CLUSTER_EXTRAS`: a LocalPSCluster's scheduler shows the page."""

    def before_start(self) -> None:
        from daskps.ui.dashboard import register_page

        register_page()

    def started(self, scheduler: Any) -> None:
        from daskps.ui.dashboard import add_to_navigation

        add_to_navigation(scheduler)


views.CLUSTER_EXTRAS.append(_DashboardOnLocalCluster())
