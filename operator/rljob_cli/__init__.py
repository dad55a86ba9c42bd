"""The `rljob` command line: validate, crd, explain, render, run."""
