"""The save path: a save's inputs, the snapshot, the writer thread, encoding, the commit."""
