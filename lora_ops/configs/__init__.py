"""Kernel configs: heuristic defaults that need no files (heuristics.py)."""
from lora_ops.configs.heuristics import ExpandConfig, ShrinkConfig, expand_config, shrink_config

__all__ = ["ShrinkConfig", "ExpandConfig", "shrink_config", "expand_config"]
