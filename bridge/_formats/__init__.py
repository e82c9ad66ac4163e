"""Formats: the plug-in registry, the universal directory (ours), safetensors files, convert /
export / diff and the multi-process scale-out they use."""
