"""The protocol every layer speaks, at the bottom of the house: the messages between ranks,
agents, the controller and operators (:mod:`.messages`), the rank side's builders of them
(:mod:`.rank_side`: what a rank sends, for the real ranks and the simulators alike), the
mitigation actions (:mod:`.actions`), the commands (:mod:`.commands`), the strict wire codec
with its size cap and schema version (:mod:`.codec`), and the run's event log
(:mod:`.eventlog`). Nothing here imports another falconext package."""
