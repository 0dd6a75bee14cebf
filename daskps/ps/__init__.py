"""The parameter server and its client.

``server`` is the actor that holds arrays (it imports only the numpy core);
``protocol`` is the only code that talks to servers; ``group`` starts and
releases a strategy's servers; ``refs`` keeps server-side objects alive
exactly as long as some process holds a handle to them.
"""
