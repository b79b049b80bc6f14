"""The restore path: which checkpoint a resume takes, reading, verifying, resharding."""
