"""What people see, on top of every other layer: reprs for Jupyter, the dashboard page and plots,
progress bars, TensorBoard scalars and Prometheus' ``/metrics``.

Nothing below imports this package. The domain hands plain views of itself
(:mod:`daskps._core.views`) and these modules register, when imported, how
each view is drawn, the checkpoint's progress bar, the scheduler plugin's
``/metrics`` collector and a ``LocalPSCluster``'s dashboard page;
``import daskps`` imports them all.
"""

from daskps.ui import dashboard, display, progress, prometheus  # noqa: F401  (each registers its drawers)
