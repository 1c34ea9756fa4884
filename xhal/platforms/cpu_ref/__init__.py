"""The CPU reference platform: plain torch, written to be obviously right; the suite's oracle."""
