"""HTTP serving around the Generator."""
