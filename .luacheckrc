-- luacheck's settings for numa-infer's Lua (scripts/test): `luacheck --config
-- numad_infer/frontdoor/lua/.luacheckrc numad_infer/frontdoor/lua tests/lua`.
std = "lua53"
max_line_length = 120
-- What HAProxy 2.6 gives a script: read, never set.
read_globals = {"core", "filter"}
-- The unit tests (busted) and their fake of HAProxy.
files["tests/lua"] = {std = "+busted"}
