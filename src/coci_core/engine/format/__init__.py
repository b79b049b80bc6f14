"""The on-disk format: the manifest, the state's tree, DTensor regions, torch.save'd values."""
