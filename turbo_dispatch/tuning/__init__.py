"""The persistent tuning database: environment stamps, the JSONL store, its layers, and the
offline tuning flow. See docs/tuning-db.md for the file format."""
