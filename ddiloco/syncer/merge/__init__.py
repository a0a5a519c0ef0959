"""A round's merge: running sums of the answers, the robust trimmed mean, the outer step, buffers."""
