"""Configs: ``CfgNode`` (``cfgnode``), its YAML (``yaml_io``) and ``Registry``
(``registry``). Leaves: they import nothing of execution.
"""
