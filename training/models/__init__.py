"""The model families that ship with the platform, one file each (see ``training.sdk``)."""
