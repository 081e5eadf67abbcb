"""Where the package's own Hydra config lies on disk (the simulator's and the bench's search path): apart
from :mod:`flodl_exp.constants`, which the control core imports and which names no path."""
from __future__ import annotations

import os

# The Hydra config the package ships: flodl_exp/conf, a link to the repository's top-level conf/ in a checkout (one
# source of truth), real files in an installed wheel (the build copies them through the link as package data).
CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
