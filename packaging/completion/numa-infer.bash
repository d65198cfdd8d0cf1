# bash completion for numa-infer                           -*- shell-script -*-
# Installed as /usr/share/bash-completion/completions/numa-infer.

_numa_infer()
{
    local cur prev words cword split
    _init_completion -s || return

    local commands="topology plan render check run status health reload tune doctor"
    local global_opts="--config --fsroot --state-file"

    # Options that take an argument.
    case $prev in
        --config)
            _filedir toml
            return
            ;;
        --state-file)
            _filedir json
            return
            ;;
        --fsroot | --output)
            _filedir -d
            return
            ;;
        --backend)
            COMPREPLY=($(compgen -W 'auto systemd process' -- "$cur"))
            return
            ;;
        --pid)
            _pids
            return
            ;;
        --timeout | --nodes | --samples | --tokens)
            return
            ;;
    esac
    $split && return

    # The command is the first word that is neither an option nor an option's argument.
    local i command=""
    for ((i = 1; i < cword; i++)); do
        case ${words[i]} in
            --config | --fsroot | --state-file | --output | --backend | --pid | --timeout | --nodes | --samples | --tokens)
                ((i++))
                ;;
            -*) ;;
            *)
                command=${words[i]}
                break
                ;;
        esac
    done

    if [[ -z $command ]]; then
        if [[ $cur == -* ]]; then
            COMPREPLY=($(compgen -W "$global_opts --help --version" -- "$cur"))
        else
            COMPREPLY=($(compgen -W "$commands" -- "$cur"))
        fi
        return
    fi

    local opts=""
    case $command in
        topology | plan | status) opts="--json" ;;
        render) opts="--output" ;;
        check) opts="" ;;
        run) opts="--backend --verbose" ;;
        reload) opts="--pid --timeout" ;;
        health) opts="--live --ready" ;;
        doctor) opts="--json --sample" ;;
        tune) opts="--nodes --quick --json --apply --stop-instances --layouts --samples --tokens" ;;
        *) return ;;
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts $global_opts --help" -- "$cur"))
    fi
} &&
    complete -F _numa_infer numa-infer

# ex: filetype=sh
