"""The run's report: its summary (summary.json), the device's figures and the figures and report.html."""
