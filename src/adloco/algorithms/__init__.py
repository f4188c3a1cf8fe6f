"""Pure tensor math with no processes and no I/O: outer steps, batch tests, merges, switch mode, fragments, codecs."""
