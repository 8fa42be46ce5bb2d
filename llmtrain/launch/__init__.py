"""Launching: hostfiles, torchrun command expansion, local and SSH runners. Never imports torch."""
