"""What people see: reprs for Jupyter, the dashboard page, progress bars.

These render objects from above by their attributes and ask the servers
for counters through the protocol; they import nothing above ``ps``.
"""
