"""Other checkpoint formats: reading DCP and torch.save files, exporting and importing."""
