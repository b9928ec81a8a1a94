"""The command-line application on top of the library: flags, the training loop, runs, generation, benchmarks."""
