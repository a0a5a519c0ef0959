"""After pre-training: evaluation, SFT, the run summary and the HTML report."""
