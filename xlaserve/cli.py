"""Console-script entry point; the commands live in serving/cli.py."""

from serving.cli import main

__all__ = ["main"]
