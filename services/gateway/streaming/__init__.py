"""One generation's life between a door and the scheduler: the scheduler client, the stream of events, and continuing a stream after the scheduler restarted."""
