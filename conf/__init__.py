"""The Hydra config (a package so an installed flodl_exp finds it as pkg://flodl_exp.conf)."""
