"""The checkpoint engine: snapshot, persist, commit, restore, and the on-disk format."""
