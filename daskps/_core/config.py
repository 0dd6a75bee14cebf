"""daskps' configuration defaults, registered with Dask's config as ``daskps.*``.

Every key with its default and a comment is in ``daskps/daskps.yaml``, as
``distributed/distributed.yaml`` is Dask's; importing daskps registers them
with ``dask.config.update_defaults``, so code reads ``dask.config.get(key)``
with no default of its own, and the usual ways of setting Dask config apply
(a YAML file, ``dask.config.set``, ``DASK_DASKPS__...`` environment variables,
which worker processes inherit).
"""

from __future__ import annotations

import pathlib

import dask.config

PATH = pathlib.Path(__file__).resolve().parent.parent / "daskps.yaml"

# Dask's own YAML reader, as for its config files.
(DEFAULTS,) = dask.config.collect_yaml([str(PATH)])

dask.config.update_defaults(DEFAULTS)
