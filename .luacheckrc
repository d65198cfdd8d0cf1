-- luacheck's settings for numa-infer's Lua, at the repository's root so that a bare
-- `luacheck numad_infer/frontdoor/lua tests/lua` run from it reads them (scripts/test runs
-- exactly that).
std = "lua53"
max_line_length = 120
-- What HAProxy 2.6 gives a script: read, never set.
read_globals = {"core", "filter"}
-- The unit tests (busted) and their fake of HAProxy.
files["tests/lua"] = {std = "+busted"}
