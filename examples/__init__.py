"""The mokv command line and its pipelines."""
